# SPDX-License-Identifier: Apache-2.0
"""A model's weights sharded over a process group with torch's FSDP2, for inference.

Each rank keeps 1/W of every parameter between forwards; a unit (a transformer block) gathers its
parameters just before it runs and frees them after (``reshard_after_forward=True``), and the
next unit's gather is issued while the current one computes (FSDP2's explicit forward prefetch,
:meth:`FSDPModule.set_modules_to_forward_prefetch`). The engine is torch's
(:func:`torch.distributed.fsdp.fully_shard`): no hand-written gather.

    summary = shard_module(model, ["blocks.0", "blocks.1", ...], group)   # in place

Contracts:

- **Inference only.** Every parameter is frozen (``requires_grad_(False)``); a backward would
  reduce-scatter gradients nobody asked for.
- **Same numbers.** FSDP2 gathers the exact bytes of each shard (no mixed precision policy: each
  parameter keeps its dtype, float32 modules stay float32), so a forward computes what the
  unsharded model computes, bit for bit.
- **FP8 weights stay FP8, in memory and on the wire.** FSDP2 shards parameters, not buffers, and
  torchao's inference ``Float8Tensor`` has no FSDP2 all-gather extension. So before sharding,
  every FP8 linear holds its e4m3 codes and float32 scales as plain frozen parameters: a torchao
  FP8 linear becomes the module :func:`register_fp8_linear` registered, built on the same codes
  and scales (the same recipe: per-row e4m3 activation codes, ``torch._scaled_mm``), and every
  module that names its quantized tensors (:class:`HoldsQuantizedTensors`: its ``quantized``
  attribute) has those buffers made parameters of the same names. A unit whose parameters mix
  dtypes is gathered as raw bytes (FSDP2's uint8 path): the e4m3 codes travel as one byte each.
- **Order.** Shard after everything that swaps modules or parameters (quantizing, loading) and
  after hooks that read module types (``enable_ulysses``), before compiling the units: a unit
  compiled first is refused.
- **A model built on the meta device** (:func:`parameters_on_meta`) is materialised one unit at
  a time, so that no rank ever holds more than its shards, the root's parameters and one unit
  unsharded: the modules are visited in registration order (``root.named_modules()``: the order
  a model's constructor draws its initialisation in), each one whose own parameters are on meta
  is given storage on ``device`` and handed to ``materialize``, and each unit is sharded as soon
  as its last module is filled.
"""

from __future__ import annotations

import logging
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from dist_attn.distributed import group_size_and_rank
from dist_attn.weight_codes import (Fp8LinearFactory, HoldsQuantizedTensors, check_torchao_linears,
                                    fp8_buffers_to_parameters, quantized_names, register_fp8_linear,
                                    torchao_to_fp8_linear)

__all__ = ["Fp8LinearFactory", "HoldsQuantizedTensors", "ShardedWeights", "is_sharded",
           "meta_parameters", "parameter_bytes", "parameters_on_meta", "quantized_names",
           "refuse_sharded", "register_fp8_linear", "shard_module", "sharded_weights"]

logger = logging.getLogger(__name__)

_ATTR = "_dist_attn_sharded_weights"


@dataclass(kw_only=True, frozen=True)
class ShardedWeights:
    """What :func:`shard_module` did to one model, on this rank."""

    units: tuple[str, ...]
    """Dotted names of the units, each gathered alone, in the order they run; the root (the
    parameters outside every unit) is one more, gathered for the whole forward."""
    world: int
    """Ranks the weights are sharded over."""
    bytes_total: int
    """Bytes of every parameter of the unsharded model."""
    bytes_per_rank: int
    """Bytes of parameters this rank keeps between forwards (its shards, padding included)."""
    largest_unit_bytes: int
    """Bytes of the largest unit unsharded: what one gather materialises."""
    root_bytes: int
    """Bytes of the root's own parameters unsharded (held during the whole forward)."""
    fp8_tensors: int
    """FP8 codes and scales made parameters (and so sharded as raw e4m3 / float32 bytes)."""
    torchao_linears: int
    """torchao FP8 linears replaced by the registered FP8 linear (:func:`register_fp8_linear`;
    same codes)."""
    prefetch: int
    """Units whose gather is issued ahead of the one running."""
    wrapped: bool = True
    """Whether FSDP2 wraps the model: False without a process group (nothing was sharded)."""

    def describe(self) -> str:
        """One log line."""
        if not self.wrapped:
            return (f"weights not sharded (no process group): {self.bytes_total / 1e9:.2f} GB of "
                    "parameters on this rank")
        if self.world == 1:
            return (f"weights wrapped by FSDP2 over a group of one rank: every weight stays whole "
                    f"({self.bytes_total / 1e9:.2f} GB on this rank), each unit copied for its "
                    f"forward; {self.fp8_tensors} FP8 tensors as parameters ("
                    f"{self.torchao_linears} torchao linears as Fp8Linear)")
        return (f"weights sharded over {self.world} ranks with FSDP2: {len(self.units)} units + "
                f"the root, {self.bytes_total / 1e9:.2f} GB -> {self.bytes_per_rank / 1e9:.2f} GB "
                f"per rank between forwards; the largest unit gathers "
                f"{self.largest_unit_bytes / 1e9:.3f} GB, the root {self.root_bytes / 1e9:.3f} GB "
                f"(held for the forward); prefetch {self.prefetch}; {self.fp8_tensors} FP8 "
                f"tensors sharded as raw bytes ({self.torchao_linears} torchao linears as "
                "Fp8Linear)")


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s weights, unsharded: its parameters (a torchao FP8 weight: its codes
    and scales; an FSDP2 parameter: its global size) and the quantized tensors that
    :class:`HoldsQuantizedTensors` modules hold as buffers."""
    total = sum(t.numel() * t.element_size() for m in module.modules() for k in quantized_names(m)
                if (t := m._buffers.get(k)) is not None)
    for p in module.parameters():
        if hasattr(p, "qdata"):
            total += p.qdata.numel() * p.qdata.element_size() + p.scale.numel() * p.scale.element_size()
        else:
            total += p.numel() * p.element_size()  # a DTensor's numel is the global one
    return total


def _local_bytes(module: nn.Module) -> int:
    """Bytes of this rank's storage of ``module``'s parameters (an FSDP2 shard, padding
    included, is one padded row block of the global tensor)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def sharded_weights(module: nn.Module) -> ShardedWeights | None:
    """The :class:`ShardedWeights` of a model :func:`shard_module` sharded, or None."""
    return getattr(module, _ATTR, None)


def meta_parameters(module: nn.Module, what: str = "model") -> str:
    """'' when no parameter of ``module`` is on the meta device; else the start of an error
    message: how many of the ``what``'s parameters are, and the first names."""
    names = [n for n, p in module.named_parameters() if p.is_meta]
    if not names:
        return ""
    return (f"{len(names)} of the {what}'s parameters are on the meta device "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")


def is_sharded(module: nn.Module) -> bool:
    """Whether :func:`shard_module` wrapped ``module`` in FSDP2 (without a process group it
    leaves the model as it was)."""
    summary = sharded_weights(module)
    return summary is not None and summary.wrapped


def refuse_sharded(module: nn.Module, call: str) -> None:
    """Raises ValueError when :func:`shard_module` already sharded ``module``: ``call`` (a
    function that swaps modules or reads the model's class) must come first."""
    if is_sharded(module):
        raise ValueError(f"this model's weights are already sharded (shard_weights / "
                         f"shard_module): call {call} first, then shard the weights")


def shard_module(root: nn.Module, units: Sequence[str], group=None, *, prefetch: int = 1,
                 materialize: Callable[[str, nn.Module], None] | None = None,
                 prepare: Callable[[str, nn.Module], None] | None = None,
                 device: torch.device | str | None = None) -> ShardedWeights:
    """Shards ``root``'s parameters over the ranks of ``group`` with FSDP2, in place; returns a
    :class:`ShardedWeights`, also logged at INFO.

    Afterwards every rank calls ``root`` as before with the same inputs, running every unit in
    the same order (each unit's gather is a collective), and gets the unsharded model's outputs.
    Contracts (inference only, FP8 kept, order, a model built on meta): the module docstring.

    Args:
        root: the model, its parameters on the device it computes on (CUDA with NCCL, CPU with
            gloo) or on the meta device (then ``materialize`` and ``device`` are required), every
            rank holding (or materialising) the same weights.
        units: dotted names of the submodules gathered one at a time, in the order they run
            (each transformer block); their parameters must not be shared with other units.
        group: process group to shard over (None = the default group); torch.distributed not
            initialised: nothing is sharded (one rank holds the whole model), ``world=1``.
        prefetch: how many units ahead each unit's gather is issued (1: the next, while the
            current unit computes; 0: when its unit starts); a prefetched unit is held unsharded.
        materialize: ``materialize(name, module)`` fills ``module``'s own parameters (uninitialised
            storage on ``device``, same shapes and dtypes), e.g. ``module.reset_parameters()``
            under a seeded generator, or a copy from a checkpoint.
        prepare: ``prepare(name, module)`` runs on each unit once materialised, then on the root
            (``name == ""``), each before it is sharded: where to quantize a block or re-draw
            modules in another dtype.
        device: where ``materialize``'d storage lives (this rank's device).

    Raises:
        ValueError: ``units`` is empty, names a missing module, repeats or nests one; the model
            is already sharded; a unit is already compiled; ``prefetch`` is not a non-negative
            int; a torchao FP8 linear has a bias or non-per-row scales, or no FP8 linear is registered
            (:func:`register_fp8_linear`); meta parameters without
            ``materialize`` and ``device``, or left on meta after it.
    """
    names, modules = _checked_units(root, units, prefetch)
    meta = meta_parameters(root)
    if meta and (materialize is None or device is None):
        raise ValueError(f"{meta}: pass materialize= and device= to fill them unit by unit")
    group, world, _ = group_size_and_rank(group)
    mesh = _fsdp_mesh(group, root, device)
    if mesh is not None:  # the FP8 linears already quantized: refused before anything changes
        check_torchao_linears(root)
    root.requires_grad_(False)
    run = _Sharding(root=root, mesh=mesh, prepare=prepare)
    run.walk(modules, materialize if meta else None, device)
    total = run.finish_root(names)
    if run.mesh is not None:
        _set_prefetch(root, [modules[n] for n in names], prefetch)
    summary = run.summary(names, world, total, prefetch)
    setattr(root, _ATTR, summary)
    logger.info("shard_module: %s", summary.describe())
    return summary


def _checked_units(root: nn.Module, units: Sequence[str], prefetch: int) -> tuple[list, dict]:
    """``(names, name -> module)`` of ``units``; ValueError for a bad ``prefetch``, no unit, a
    repeated, missing, compiled or nested one, or a model already sharded."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r} must be a non-negative int")
    names = list(units)
    if not names:
        raise ValueError("units=[] names no unit; pass the dotted names of the blocks to gather "
                         "one at a time")
    if len(set(names)) != len(names):
        raise ValueError(f"units={names!r} repeats a name")
    if is_sharded(root):
        raise ValueError("this model's weights are already sharded (shard_module ran before)")
    modules = {}
    for name in names:
        try:
            module = root.get_submodule(name)
        except AttributeError:
            raise ValueError(f"units: {name!r} is not a submodule of {type(root).__name__}") from None
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise ValueError(f"units: {name!r} is already compiled; shard the weights before "
                             "compiling the blocks (a compiled graph captured the unsharded "
                             "parameters)")
        modules[name] = module
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"units: {b!r} lies inside {a!r}; units must not nest")
    return names, modules


def _fsdp_mesh(group, root: nn.Module, device):
    """The 1-D DeviceMesh FSDP2 shards over: ``group`` on ``device``'s type (None: the first
    parameter's device, else CPU); None without a process group (nothing to shard over)."""
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if device is None:
        device = next((p.device for p in root.parameters()), torch.device("cpu"))
    return DeviceMesh.from_group(group, torch.device(device).type)


@dataclass
class _Sharding:
    """One :func:`shard_module` run: the units finished so far and what they held."""

    root: nn.Module
    mesh: object
    prepare: Callable[[str, nn.Module], None] | None
    torchao: int = 0
    fp8: int = 0
    unit_bytes: list[int] = field(default_factory=list)

    def walk(self, modules: dict, materialize, device) -> None:
        """Visits the modules in registration order, materialising each whose own parameters are
        on meta (``materialize`` None: none is), and finishes each unit after its last module."""
        open_unit = None
        for name, module in list(self.root.named_modules()):
            if open_unit is not None and not name.startswith(open_unit + "."):
                self.finish(open_unit, modules[open_unit])
                open_unit = None
            if name in modules:
                open_unit = name
            if materialize is not None and any(p.is_meta for p in module.parameters(recurse=False)):
                module.to_empty(device=device, recurse=False)
                materialize(name, module)
        if open_unit is not None:
            self.finish(open_unit, modules[open_unit])

    def finish(self, name: str, module: nn.Module) -> None:
        """``prepare``, the meta check, FP8 tensors as parameters and ``fully_shard`` for the unit
        ``name`` (``""``: the root)."""
        if self.prepare is not None:
            self.prepare(name, module)
        left = [n for n, p in module.named_parameters() if p.is_meta]
        if left:
            raise ValueError(f"{name or type(self.root).__name__}: parameters still on the meta "
                             f"device after materialize: {left[:5]}")
        if self.mesh is not None:
            self.torchao += torchao_to_fp8_linear(module)
            self.fp8 += fp8_buffers_to_parameters(module)
        if name:
            self.unit_bytes.append(parameter_bytes(module))
        if self.mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(module, mesh=self.mesh, reshard_after_forward=True)

    def finish_root(self, names: list) -> int:
        """After :meth:`walk` reached every unit of ``names`` (ValueError if not): the root
        finished too; returns the bytes of every parameter of the unsharded model."""
        if len(self.unit_bytes) != len(names):
            raise ValueError(f"units: {len(names) - len(self.unit_bytes)} of {names} were not "
                             "reached in root.named_modules()")
        total = parameter_bytes(self.root)
        self.finish("", self.root)
        return max(total, parameter_bytes(self.root))  # the root's swaps made FP8 buffers parameters

    def summary(self, names: list, world: int, total: int, prefetch: int) -> ShardedWeights:
        """What the run did, on this rank (``total``: :meth:`finish_root`'s bytes)."""
        wrapped = self.mesh is not None
        return ShardedWeights(units=tuple(names), world=world, bytes_total=total,
                              bytes_per_rank=_local_bytes(self.root) if wrapped else total,
                              largest_unit_bytes=max(self.unit_bytes),
                              root_bytes=total - sum(self.unit_bytes), fp8_tensors=self.fp8,
                              torchao_linears=self.torchao, prefetch=prefetch, wrapped=wrapped)


def _set_prefetch(root: nn.Module, ordered: list, prefetch: int) -> None:
    """The root frees its parameters after a forward like every unit (FSDP2 keeps them gathered
    for training's backward); each unit's gather is issued ``prefetch`` units ahead."""
    root.set_reshard_after_forward(True)
    if prefetch:
        root.set_modules_to_forward_prefetch(ordered[:prefetch])
        for i, module in enumerate(ordered[:-1]):
            module.set_modules_to_forward_prefetch(ordered[i + 1:i + 1 + prefetch])


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers goes to the meta device (no storage, no
    initialisation drawn), while buffers stay where the constructor makes them (RoPE frequency
    tables and the like keep their computed values). Build a model inside (under
    ``torch.device(d)`` for buffers on ``d``), then let :func:`shard_module` materialise it unit
    by unit. Parameters a constructor draws before registering them (``nn.Parameter(torch.randn(
    ...))``) consume the generator here and lose their values: ``materialize`` must fill them."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
