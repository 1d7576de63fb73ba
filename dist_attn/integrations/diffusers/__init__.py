# SPDX-License-Identifier: Apache-2.0
"""Sequence-parallel diffusers video transformers with dist_attn's Ulysses attention.

Every rank of the group builds the same pipeline, calls it with the same inputs and gets the full
output, as with diffusers' own ``enable_parallelism``; in between, each rank's transformer blocks
work on 1/W of the tokens, and each self-attention is one pair of all-to-alls::

    from dist_attn import init_distributed
    from dist_attn.integrations.diffusers import enable_ulysses

    env = init_distributed()                              # under torchrun: this rank's GPU
    pipe.to(env.device)
    handle = enable_ulysses(pipe.transformer)             # any time before the call
    video = pipe(prompt, generator=torch.Generator().manual_seed(0)).frames  # same on every rank
    handle.remove()                                       # back to single-device attention

Unlike diffusers' context parallelism, sequence lengths and head counts need not be multiples of
the rank count W: the sequence is padded to a multiple of W (padding keys are never attended),
and heads (times the batch) are spread unevenly. Forward only. With ``mesh=`` (a ``("ring",
"ulysses")`` mesh from :func:`dist_attn.init_usp_mesh`) the attention is Ulysses x Ring.

The video VAE's decode goes over the same ranks with :func:`enable_parallel_decode`: every rank
calls ``vae.decode(z)`` with the same latents and gets the same video, each rank having decoded
1/W of the (clip, tile) decoder calls; :func:`compile_vae_decoder` compiles the decoder's blocks.

Supported models are those listed by :func:`supported_models`; any other transformer is refused
with a ``TypeError``. Without an initialised process group (or with a group of one rank) the
model runs on one rank with dist_attn's attention kernel and no collectives.

FP8 linear layers are MiniMax-H3's, a separate, explicit call:
:func:`dist_attn.models.h3.fp8.quantize_linears` (``transformer, "fp8"``) swaps weights in place and
has no undo, whereas ``enable_ulysses`` is undone by ``handle.remove()``; the two may be applied in
either order.

:func:`shard_weights` shards the transformer's weights over the ranks with FSDP2 (each rank keeps
1/W; a block gathers its weights just before it runs): after both of the above, before compiling.
"""

from __future__ import annotations

from dist_attn.extras import install_hint

try:
    import diffusers as _diffusers
except ImportError as _exc:  # optional dependency: only this subpackage needs it
    raise ImportError(
        "dist_attn.integrations.diffusers needs the diffusers package, which is not installed: "
        + install_hint("diffusers")
    ) from _exc

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Iterator

from torch import nn

from dist_attn import SequenceShard
from dist_attn._moved import moved_attribute
from dist_attn.backends import available_backends
from dist_attn.distributed import group_size_and_rank, register_for_compile
from dist_attn.integrations.diffusers._runtime import Runtime, fuses_qk_norm_rope, install_hooks
from dist_attn.integrations.diffusers._spec import ModelSpec
from dist_attn.integrations.diffusers._ltx import LTX
from dist_attn.integrations.diffusers._minimax_h3 import MINIMAX_H3
from dist_attn.integrations.diffusers._wan import WAN
from dist_attn.integrations.diffusers._vae_decode import (DEFAULT_DECODE_BUDGET_BYTES, DecodeStats,
                                                          ParallelDecodeHandle, decoder_tile_bytes,
                                                          enable_parallel_decode, supported_vaes,
                                                          tiles_within_budget)
from dist_attn.integrations.diffusers.vae_compile import compile_vae_decoder
from dist_attn.integrations.diffusers.weight_sharding import (ShardedWeights, shard_weights,
                                                              sharded_weights, weight_units)
from dist_attn.mesh import check_mesh_or_group, parallel_groups
from dist_attn.profiling import PhaseTimer
from dist_attn.validation import CheckedScalars, checked_scalars, positive_int
from dist_attn.weight_sharding import refuse_sharded

__all__ = ["DEFAULT_DECODE_BUDGET_BYTES", "DecodeStats", "ParallelDecodeHandle", "ShardedWeights",
           "UlyssesHandle", "compile_vae_decoder", "decoder_tile_bytes", "disable_ulysses",
           "enable_parallel_decode", "enable_ulysses", "shard_weights", "sharded_weights",
           "supported_models", "supported_vaes", "tiles_within_budget", "ulysses_handle",
           "weight_units"]

logger = logging.getLogger(__name__)

#: The diffusers release the adapter was written and tested against (the ``diffusers`` extra
#: pins it); the per-model processors reproduce that release's attention math.
TESTED_DIFFUSERS = "0.42.1"

# One owner for "which models are supported": the class name -> its plan.
_SPECS: dict[str, ModelSpec] = {spec.model_class.__name__: spec for spec in (WAN, LTX, MINIMAX_H3)}
_HANDLE_ATTR = "_dist_attn_ulysses"


def __getattr__(name: str):
    """``quantize_linears`` and ``LinearQuantization``, which moved to
    :mod:`dist_attn.models.h3.fp8`: imported from there on first use, with a DeprecationWarning."""
    return moved_attribute(__name__, name)


def supported_models() -> tuple[str, ...]:
    """Names of the diffusers transformer classes :func:`enable_ulysses` accepts."""
    return tuple(_SPECS)


@dataclass(eq=False)
class UlyssesHandle:
    """What :func:`enable_ulysses` changed on one transformer; :meth:`remove` undoes all of it."""

    transformer: nn.Module = field(repr=False)
    runtime: Runtime = field(repr=False)
    processors: list = field(default_factory=list, repr=False)
    """``(attention module, its original processor)`` pairs."""
    removed: bool = False

    @property
    def group(self):
        """The process group as given (None = the default group)."""
        return self.runtime.group

    @property
    def mesh(self):
        """The ``("ring", "ulysses")`` mesh as given, or None."""
        return self.runtime.mesh

    @property
    def sequence_bucket(self) -> int:
        """``sequence_bucket`` as given to :func:`enable_ulysses`: each forward pads its S rows to
        a multiple of ``W * ceil(sequence_bucket / W)``
        (:func:`dist_attn.sharding.padded_length` with :func:`dist_attn.sharding.bucket_multiple`)."""
        return self.runtime.sequence_bucket

    @contextlib.contextmanager
    def sequence(self, seq_len: int) -> Iterator[SequenceShard]:
        """Plans a sequence of ``seq_len`` rows for calls of the transformer's blocks OUTSIDE its
        forward (a benchmark or a test of one block); the transformer's own forward plans its
        sequence itself. Inside, a block takes what its hooks cut (H3's first block: the full
        ``[B, S, hidden]`` hidden states and every block: the full ``adaln_indices``), the rest as
        this rank's rows (the RoPE tables), and returns this rank's rows."""
        rt = self.runtime
        if rt.shard is not None:
            raise RuntimeError("handle.sequence() inside a forward of the transformer")
        rt.plan(seq_len)
        try:
            yield rt.shard
        finally:
            rt.shard = None

    def remove(self) -> None:
        """Restores diffusers' processors and removes every hook; calling it twice is a no-op."""
        if self.removed:
            return
        for hook in self.runtime.handles:
            hook.remove()
        self.runtime.handles.clear()
        for attn, original in self.processors:
            attn.set_processor(original)
        self.processors.clear()
        if getattr(self.transformer, _HANDLE_ATTR, None) is self:
            delattr(self.transformer, _HANDLE_ATTR)
        self.removed = True

    def __enter__(self) -> "UlyssesHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def enable_ulysses(transformer: nn.Module, group=None, *, mesh=None, backend: str = "auto",
                   timer=None, overlap_chunks: int = 1, sequence_bucket: int = 1) -> UlyssesHandle:
    """Makes ``transformer`` sequence-parallel over the ranks of ``group`` (or ``mesh``), in place.

    Afterwards every rank calls ``transformer(...)`` (or its pipeline) with the same full inputs,
    under ``torch.no_grad()`` or ``torch.inference_mode()``, and gets the same full output. Each
    forward first checks, in one small all-gather, that the ranks' inputs agree in shapes and
    contents: a rank with another seed or resolution raises ``ValueError`` on every rank.

    Args:
        transformer: a diffusers transformer of a class in :func:`supported_models`, whose
            self-attention modules still hold diffusers' default processor.
        group: process group of the Ulysses ranks (None = the default group; not initialised or
            one rank = local attention, no collectives).
        mesh: instead of ``group``, a ``("ring", "ulysses")`` DeviceMesh over the whole default
            group, shard ``r*U + u`` at global rank ``r*U + u`` (as :func:`dist_attn.init_usp_mesh`
            builds it): the all-to-all runs inside each Ulysses row and K/V rotate around the ring
            (needs a backend with a log-sum-exp, e.g. ``"sdpa"``).
        backend: dist_attn attention backend for the self-attention (``"auto"``, ``"sdpa"``,
            ``"sage8"``, ...; see :func:`dist_attn.available_backends`).
        timer: optional :class:`dist_attn.PhaseTimer` that every eager self-attention reports its
            phases to (pack, all-to-alls, kernel, ...); compiled attention reports nothing.
        overlap_chunks: C > 1 cuts each attention call's heads into C chunks whose all-to-alls
            run under the other chunks' kernels (see :func:`dist_attn.ulysses_attention`); 1 =
            the plain path. The output is the same up to the kernel's per-head arithmetic.
        sequence_bucket: the packed S rows are padded at their end (never attended, dropped from
            the output) to a multiple of ``W * ceil(sequence_bucket / W)`` (1: of W only), so
            that blocks under ``torch.compile(dynamic=False)`` see one shape, and compile once,
            for every S of a bucket (the true length reaches the attention as a tensor); costs up
            to that multiple - 1 rows of work outside the attention.

    Returns:
        A :class:`UlyssesHandle`; ``handle.remove()`` (or leaving ``with handle:``) restores the
        transformer.

    Raises:
        TypeError: ``transformer`` is not a supported model class.
        ValueError: an argument is invalid, or the transformer is already enabled or holds a
            non-default attention processor or diffusers' own context parallelism.
    """
    spec = _supported_spec(transformer)
    checked = _check_arguments(group, mesh, backend, timer, overlap_chunks, sequence_bucket)
    attns = _default_attentions(transformer, spec)
    register_for_compile(group, mesh)  # compiled attention's group key, entered outside traced code
    runtime = Runtime(spec=spec, group=group, mesh=mesh, backend=backend, timer=timer, checked=checked,
                      sequence_bucket=int(sequence_bucket), fused_qk_norm_rope=fuses_qk_norm_rope(backend))
    return _install(transformer, attns, runtime)


def _supported_spec(transformer: nn.Module) -> ModelSpec:
    """The plan of ``transformer``'s exact class; TypeError for another class (or a non-module),
    ValueError for a model whose weights are already sharded."""
    if not isinstance(transformer, nn.Module):
        raise TypeError(f"transformer={type(transformer).__name__!r} must be a diffusers model "
                        f"(a torch.nn.Module); supported: {', '.join(supported_models())}")
    refuse_sharded(transformer, "enable_ulysses")  # FSDP2 changed the model's class
    spec = _SPECS.get(type(transformer).__name__)
    if spec is None or type(transformer) is not spec.model_class:
        raise TypeError(
            f"transformer of type {type(transformer).__module__}.{type(transformer).__qualname__} "
            f"is not supported by dist_attn.integrations.diffusers; supported: "
            f"{', '.join(supported_models())} (exact classes: a subclass may change forward)"
        )
    return spec


def _check_arguments(group, mesh, backend, timer, overlap_chunks, sequence_bucket) -> CheckedScalars:
    """:func:`enable_ulysses`'s other arguments (ValueError or TypeError naming the one that is
    off); a mesh must put shard ``r*U + u`` at global rank ``r*U + u`` of the default group.
    Returns the attention calls' checked scalars (the default softmax scale, ``overlap_chunks``)."""
    if not isinstance(backend, str) or backend not in available_backends():
        raise ValueError(f"backend={backend!r} must be one of {available_backends()}")
    if timer is not None and not isinstance(timer, PhaseTimer):
        raise TypeError(f"timer={timer!r} must be a dist_attn.PhaseTimer or None")
    checked = checked_scalars(None, overlap_chunks)
    positive_int("sequence_bucket", sequence_bucket)
    group_size_and_rank(group)  # a group without torch.distributed raises here, naming it
    check_mesh_or_group(mesh, group)
    if mesh is not None:
        groups = parallel_groups(mesh=mesh)
        _, world, rank = group_size_and_rank(None)
        if groups.world != world or groups.shard != rank:
            raise ValueError(
                f"mesh={mesh!r} puts shard {groups.shard} of {groups.world} at global rank {rank} of "
                f"{world}: enable_ulysses cuts the sequence over the default group, so the mesh must "
                f"span it with shard r*U + u at global rank r*U + u (build it with "
                f"dist_attn.init_usp_mesh)"
            )
    return checked


def _default_attentions(transformer: nn.Module, spec: ModelSpec) -> list:
    """``(name, attention module)`` of every self-attention ``enable_ulysses`` takes over;
    ValueError when the transformer is already enabled, uses diffusers' context parallelism or
    holds another processor. Warns when diffusers is not the tested release."""
    if getattr(transformer, _HANDLE_ATTR, None) is not None:
        raise ValueError("this transformer is already sequence-parallel (enable_ulysses was "
                         "called before); call handle.remove() or disable_ulysses() first")
    if getattr(transformer, "_parallel_config", None) is not None:
        raise ValueError("this transformer has diffusers' own context parallelism enabled "
                         "(enable_parallelism); the two cannot be combined")
    spec.check_model(transformer)
    attns = spec.self_attention(transformer)
    for name, attn in attns:
        proc = attn.processor
        if type(proc) is not spec.expected_processor:
            raise ValueError(
                f"{name} holds a {type(proc).__name__} processor; enable_ulysses replaces only "
                f"diffusers' default {spec.expected_processor.__name__} (another processor may "
                f"compute something else, which dist_attn's would silently drop)"
            )
    if _diffusers.__version__ != TESTED_DIFFUSERS:
        logger.warning("diffusers %s is installed; dist_attn's %s processor was written for %s",
                       _diffusers.__version__, type(transformer).__name__, TESTED_DIFFUSERS)
    return attns


def _install(transformer: nn.Module, attns: list, runtime: Runtime) -> UlyssesHandle:
    """Hooks ``transformer`` and gives each of ``attns`` ``runtime``'s processor; returns the
    handle that undoes both (also kept on the transformer) and logs what was done."""
    handle = UlyssesHandle(transformer=transformer, runtime=runtime)
    install_hooks(runtime, transformer)
    for _, attn in attns:
        handle.processors.append((attn, attn.processor))
        attn.set_processor(runtime.spec.make_processor(runtime))
    setattr(transformer, _HANDLE_ATTR, handle)
    logger.info("enable_ulysses: %s, %d self-attention modules through dist_attn (backend=%r, "
                "overlap_chunks=%d, sequence_bucket=%d, %s)", type(transformer).__name__, len(attns),
                runtime.backend, runtime.overlap_chunks, runtime.sequence_bucket,
                parallel_groups(mesh=runtime.mesh, group=runtime.group).desc)
    return handle


def ulysses_handle(transformer: nn.Module) -> UlyssesHandle | None:
    """The :class:`UlyssesHandle` of a transformer :func:`enable_ulysses` made
    sequence-parallel, or None."""
    return getattr(transformer, _HANDLE_ATTR, None)


def disable_ulysses(transformer: nn.Module) -> None:
    """Undoes :func:`enable_ulysses` on ``transformer``; a no-op when it is not enabled."""
    handle = getattr(transformer, _HANDLE_ATTR, None)
    if handle is not None:
        handle.remove()
