# SPDX-License-Identifier: Apache-2.0
"""What the adapter must know about one diffusers transformer class, declared as data.

A :class:`ModelSpec` says where the token sequence is cut into shards (which submodule outputs or
inputs carry it), where it is gathered back, which attention modules are self-attention over the
sequence (those get dist_attn's processor; cross-attention to replicated text stays local), and
how to read the sequence length off the model's forward arguments. The hooks in
:mod:`._runtime` interpret it; the per-model files only declare it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

__all__ = ["ModelSpec", "ShardPoint", "ForwardInputs"]


@dataclass(frozen=True, kw_only=True)
class ShardPoint:
    """One place where a tensor that carries the token sequence is cut to this rank's rows."""

    module: str
    """Dotted path of the submodule (``""`` = the transformer's own forward arguments)."""
    where: str
    """``"output"``: the module's output (a tensor, or the tuple items in ``items``);
    ``"input"``: the positional argument ``items[0]`` (or keyword ``name``) of its forward."""
    dim: int
    """The sequence axis of that tensor."""
    items: tuple[int, ...] = ()
    """Tuple positions of the output to shard (empty: the output is one tensor); for
    ``where="input"`` the positional index of the argument."""
    name: str = ""
    """Keyword name of the argument (``where="input"`` and ``module=""``)."""
    only_if_ndim: int | None = None
    """Shard only when the tensor has this many dims (Wan 2.2's per-token timestep is ``[B, S]``,
    the usual one ``[B]``)."""


@dataclass(frozen=True, kw_only=True)
class ForwardInputs:
    """What one call of the transformer asks for, read from its (full, unsharded) arguments."""

    seq_len: int
    """S: tokens of the full sequence that the blocks attend over."""
    batch: int
    """B: samples in the call (2 for a classifier-free-guidance pair)."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How :func:`~dist_attn.integrations.diffusers.enable_ulysses` handles one model class."""

    model_class: type
    """The exact diffusers class (subclasses may change forward and are refused)."""
    read_inputs: Callable[[nn.Module, Mapping[str, Any]], ForwardInputs]
    """Reads S and B from the bound forward arguments; raises ValueError naming a bad argument."""
    compared_inputs: tuple[str, ...]
    """Forward arguments whose shapes and contents every rank must agree on."""
    num_heads: Callable[[nn.Module], int]
    """Attention heads H of the self-attention (each rank needs B*H >= W)."""
    shards: tuple[ShardPoint, ...]
    """Every tensor that carries the sequence, cut once per forward."""
    gathers: tuple[tuple[str, int], ...]
    """``(module path, dim)`` whose output is gathered back to the full sequence."""
    self_attention: Callable[[nn.Module], list[tuple[str, nn.Module]]]
    """The attention modules that attend over the sequence, by name."""
    expected_processor: type
    """The processor class those modules must hold (another one may compute something else)."""
    make_processor: Callable[[Any], Any]
    """Builds dist_attn's processor from the runtime."""
    check_model: Callable[[nn.Module], None]
    """Refuses configurations the processor does not reproduce, with a clear error."""
