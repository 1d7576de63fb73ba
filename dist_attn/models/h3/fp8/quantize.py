# SPDX-License-Identifier: Apache-2.0
"""FP8 linear layers for a diffusers transformer: which linears, and the one call that swaps them.

    from dist_attn.integrations.diffusers import enable_ulysses
    from dist_attn.models.h3.fp8 import quantize_linears

    summary = quantize_linears(pipe.transformer, "fp8")   # in place; logs what it did
    handle = enable_ulysses(pipe.transformer)             # before or after: independent

Which linears (one owner: :func:`fp8_linear_names`), for ``MiniMaxH3Transformer3DModel``: in every
``transformer_blocks.*``, the self-attention's q/k/v/out projections and the SwiGLU FFN's two
linears (``attn.*``, ``ff.*``): 6 per block, every GEMM of the block that runs over the rows
(H3: 385M of the block's 645M weights). Never quantized: the modules the class keeps in float32
(``_keep_in_fp32_modules``: the input projections, the time MLP, the output heads, RoPE), the text
``context_embedder``, the 2-block ``token_refiner`` (512 text rows against the blocks' 38k: 0.2%
of the work), ``norm_out`` and every block's ``adaln_proj``: it projects the 2-3 distinct
timesteps, not the rows, so it is a memory-bound GEMV (260M weights a block: FP8 would save 13 GB
over 50 blocks but ~0.05 ms a block at 4.8 TB/s); left to a measured decision.

The swap is not undone by :meth:`UlyssesHandle.remove` and has no undo of its own: the bf16
weights are dropped (that is the memory saved). Quantize a fresh model to go back.

Options of :func:`quantize_linears` in full:

- ``fast_accum``: Hopper's FP8 accumulator without periodic float32 promotion (faster, fewer bits
  kept over K = 5,376-14,336). The emulation accumulates in float32: the summary says it has no
  effect there.
- ``fuse_swiglu``: with torchao on CUDA, a block's SwiGLU FFN becomes
  :class:`~dist_attn.models.h3.fp8.linear.Fp8SwiGLUFeedForward`: the SwiGLU and the down
  projection's activation quantization run as one kernel (one read of the FFN's projection
  instead of two; docs/diffusers.md has the timings). The same recipe as the unfused torchao FFN,
  with the GPU's fast exponential (:mod:`dist_attn.models.h3.fp8.swiglu_kernel`). It applies to
  diffusers' bias-free SwiGLU of inner size <= 16,384 on CUDA weights, never with ``emulate``;
  the summary counts the fused FFNs.
- ``fuse_adaln``: a block's ``RMSNorm(x) * (1 + scale[idx]) + shift[idx]`` and its row
  quantization run as one kernel, before the q/k/v projections and before the FFN's, that one
  with the attention's residual step in the same pass
  (:mod:`dist_attn.models.h3.fp8.adaln_kernel`: float32 with one bf16 rounding where diffusers'
  eager path rounds four times); the block gets a forward of its own
  (:mod:`~dist_attn.models.h3.fp8.block`). The residual step's output equals diffusers' bf16 ops
  bit for bit at H3's width; compiled latents keep eager's roundings (docs/diffusers.md has the
  timings and errors). It applies to a ``MiniMaxH3TransformerBlock``; True refuses (TypeError)
  another class, other norms, a fused ``to_qkv``, another FFN, a biased projection, a norm wider
  than the kernel takes, or a forward already replaced on the instance (e.g. by a diffusers hook).
  True with ``emulate`` runs the kernel's torch reference on CPU, or the kernel under Triton's
  interpreter.
- ``blocks``: a model materialised and sharded block by block
  (:func:`dist_attn.weight_sharding.shard_module`) quantizes each block between the two.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection

import torch
from torch import nn

from dist_attn.models.h3.fp8.block import fuse_adaln_blocks
from dist_attn.models.h3.fp8.fusions import adaln_blocks, fuse_swiglu_ffns, swiglu_blocks
from dist_attn.models.h3.fp8.linear import (LINEAR_PRECISIONS, EmulatedFp8Linear, Fp8Linear,
                                            LinearPrecision, fix_zero_rows, fp8_unsupported_reason,
                                            torchao_fp8_config)
from dist_attn.weight_sharding import refuse_sharded

__all__ = ["LINEAR_PRECISIONS", "LinearPrecision", "LinearQuantization", "fp8_linear_names",
           "quantize_linears"]

logger = logging.getLogger(__name__)

# class name -> the submodule prefixes, inside each of its transformer_blocks, whose nn.Linear
# layers go FP8 (diffusers' fused to_qkv, when fused, is under attn. too)
_PLANS: dict[str, tuple[str, ...]] = {"MiniMaxH3Transformer3DModel": ("attn.", "ff.")}
_KEPT: dict[str, str] = {
    "MiniMaxH3Transformer3DModel": "context_embedder, token_refiner (every block), "
                                   "transformer_blocks.*.adaln_proj, norm_out",
}
# torch._scaled_mm needs both GEMM dims of the weight to be multiples of 16 (torchao skips such a
# layer without an error; here it is one)
_ALIGN = 16


@dataclass(kw_only=True, frozen=True)
class LinearQuantization:
    """What :func:`quantize_linears` did to one transformer."""

    precision: str
    """The precision asked for ("bf16" or "fp8")."""
    kernel: str
    """"torchao" (torch._scaled_mm), "emulated" (float32 emulation, tests) or "none" (bf16)."""
    layers: tuple[str, ...]
    """Dotted names of the linears now in FP8 (a fused FFN's down projection is named by the
    :class:`~dist_attn.models.h3.fp8.linear.Fp8SwiGLUFeedForward` that holds its weight, see
    ``fused_ffns``)."""
    bytes_before: int
    """Bytes of those layers' weights and biases before."""
    bytes_after: int
    """Bytes after: 1 per weight element plus the float32 scales (and the biases)."""
    fast_accum: bool
    """``use_fast_accum`` of the FP8 GEMMs (False: float32 accumulation)."""
    kept_fp32: tuple[str, ...]
    """The class's float32 modules (``_keep_in_fp32_modules``) whose tensors are float32, never
    quantized."""
    kept_other: str
    """Other linears left in the blocks' dtype on purpose, in words."""
    fused_ffns: tuple[str, ...] = ()
    """Dotted names of the SwiGLU FFNs now
    :class:`~dist_attn.models.h3.fp8.linear.Fp8SwiGLUFeedForward` (in ``layers`` their projection is
    ``<ff>.proj`` and their down projection ``<ff>`` itself)."""
    cast_fp32: tuple[str, ...] = ()
    """The class's float32 modules found in another dtype (a model cast after loading, e.g. by
    ``.to(torch.bfloat16)``, which diffusers warns about), as ``"name (dtype)"``: never quantized,
    left as they are."""
    fused_adaln: tuple[str, ...] = ()
    """Dotted names of the blocks whose two AdaLN inputs are quantized by the pass computing them
    (``fuse_adaln``; their q/k/v and FFN input projections are
    :class:`~dist_attn.models.h3.fp8.linear.Fp8Linear` or emulated)."""

    @property
    def count(self) -> int:
        """Number of FP8 linears."""
        return len(self.layers)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def describe(self) -> str:
        """One log line."""
        if self.precision != "fp8":
            return f"linear_precision={self.precision!r}: no linear quantized"
        emulated = self.kernel == "emulated"
        accum = f"fast_accum={self.fast_accum}" + (" (no effect: emulated)" if emulated and self.fast_accum else "")
        gemm = "the emulated GEMM" if emulated else "torch._scaled_mm"
        return (f"linear_precision='fp8': {self.count} linears in FP8 ({self.kernel}, e4m3, per-row "
                f"activation and per-channel weight scales, {accum}); weights "
                f"{_size(self.bytes_before)} -> {_size(self.bytes_after)} "
                f"({_size(self.bytes_saved)} saved); kept float32: "
                f"{', '.join(self.kept_fp32) or 'none'}"
                + (f"; the class's float32 modules found cast (never quantized): {', '.join(self.cast_fp32)}"
                   if self.cast_fp32 else "")
                + f"; kept in the blocks' dtype: {self.kept_other}"
                + (f"; SwiGLU fused with its output's quantization in {len(self.fused_ffns)} FFNs"
                   if self.fused_ffns else "")
                + (f"; norm + AdaLN modulation fused with their quantization in "
                   f"{len(self.fused_adaln)} blocks (their q/k/v and FFN input projections run "
                   f"{gemm} on those codes and the same weights)" if self.fused_adaln else ""))


def _size(n: int) -> str:
    return next((f"{n / s:.2f} {u}" for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
                 if abs(n) >= s), f"{n} B")


def _fp32_names(transformer: nn.Module) -> list[str]:
    """Submodules named by ``_keep_in_fp32_modules`` (whole name components, as diffusers' loader
    matches them)."""
    keep = set(getattr(type(transformer), "_keep_in_fp32_modules", None) or ())
    return [name for name, _ in transformer.named_modules() if name and name.split(".")[-1] in keep]


def _fp32_dtypes(transformer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The class's float32 modules split by what they hold now: (float32 ones, ``"name (dtype)"``
    of the others; a module without floating tensors is in neither)."""
    kept, cast = [], []
    for name in _fp32_names(transformer):
        module = transformer.get_submodule(name)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in (*module.parameters(), *module.buffers())
                         if t.is_floating_point()})
        if dtypes == ["float32"]:
            kept.append(name)
        elif dtypes:
            cast.append(f"{name} ({', '.join(dtypes)})")
    return tuple(kept), tuple(cast)


def fp8_linear_names(transformer: nn.Module) -> list[str]:
    """The dotted names of the linears that ``precision="fp8"`` quantizes (see the module
    docstring); raises TypeError for a class without a plan."""
    cls = type(transformer).__name__
    if cls not in _PLANS:
        raise TypeError(f"quantize_linears has no FP8 plan for {cls}; supported: "
                        f"{', '.join(_PLANS)}")
    names = []
    for i, block in enumerate(transformer.transformer_blocks):
        for sub, module in block.named_modules():
            # an already swapped layer is listed too, so that a second call is refused by name
            if isinstance(module, (nn.Linear, EmulatedFp8Linear, Fp8Linear)) and sub.startswith(_PLANS[cls]):
                names.append(f"transformer_blocks.{i}.{sub}")
    return names


def _bytes(module: nn.Module) -> int:
    """Bytes of a module's own tensors (a torchao weight: its e4m3 codes and float32 scales)."""
    total = 0
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        parts = (t.qdata, t.scale) if hasattr(t, "qdata") else (t,)
        total += sum(p.numel() * p.element_size() for p in parts)
    return total


def _check_targets(transformer: nn.Module, names: list[str]) -> None:
    fp32 = _fp32_names(transformer)
    for name in names:
        module = transformer.get_submodule(name)
        if not isinstance(module, nn.Linear) or hasattr(module.weight, "qdata"):
            raise ValueError(f"{name} is already quantized ({type(module).__name__}); "
                             "quantize_linears runs once on a freshly built model")
        if any(name == f or name.startswith(f + ".") for f in fp32):
            raise ValueError(f"{name} lies in a float32 module of {type(transformer).__name__} "
                             "(_keep_in_fp32_modules); those stay float32")
        w = module.weight
        if w.dtype != torch.bfloat16:
            raise ValueError(f"{name}.weight is {w.dtype}; FP8 linears take bfloat16 blocks "
                             "(torchao's per-row recipe quantizes bf16 weights): build the model "
                             "in bfloat16")
        if w.shape[0] % _ALIGN or w.shape[1] % _ALIGN:
            raise ValueError(f"{name}.weight has shape {tuple(w.shape)}; both dims must be "
                             f"multiples of {_ALIGN} for torch._scaled_mm")


def quantize_linears(transformer: nn.Module, precision: LinearPrecision = "fp8", *,
                     emulate: bool = False, fast_accum: bool = False,
                     fuse_swiglu: bool | str = "auto", fuse_adaln: bool | str = "auto",
                     blocks: Collection[int] | None = None) -> LinearQuantization:
    """Puts the transformer's block linears (:func:`fp8_linear_names`) in ``precision``, in place.

    Args:
        transformer: a diffusers transformer with a plan (``MiniMaxH3Transformer3DModel``), its
            blocks in bfloat16 on a CUDA device of compute capability >= 8.9.
        precision: "fp8" quantizes; "bf16" changes nothing and says so (a config value passes
            straight through; the other options are then not checked, the log names those True).
        emulate: tests only: :class:`~dist_attn.models.h3.fp8.linear.EmulatedFp8Linear` (the
            same recipe in float32, any device, slow). Never chosen automatically.
        fast_accum: ``use_fast_accum`` of ``torch._scaled_mm`` (no effect with ``emulate``).
        fuse_swiglu, fuse_adaln: the two fusions (see the module docstring). "auto": every block
            each applies to, with torchao on CUDA (not ``emulate``); True: every block, or an
            error naming the first that cannot; False: none.
        blocks: indices of the ``transformer_blocks`` to quantize (None: all; the others left as
            they are, possibly on the meta device); the summary covers those blocks and is
            logged at DEBUG.

    Returns:
        A :class:`LinearQuantization` (also logged at INFO).

    Raises:
        ValueError: a bad ``precision``; a target already quantized, not bfloat16 or not
            16-aligned; ``fuse_swiglu=True`` with ``emulate``, off CUDA or too wide an FFN.
        TypeError: no plan for the class; ``emulate`` or ``fast_accum`` not a bool; a fusion
            not True, False or "auto", or True and a block it does not apply to.
        RuntimeError: the weights' device cannot run FP8 GEMMs (CPU included), not ``emulate``.
        ImportError: torchao missing (the ``fp8`` extra) and not ``emulate``; a fusion True
            without triton.
    """
    _check_options(precision, emulate, fast_accum, fuse_swiglu, fuse_adaln)
    refuse_sharded(transformer, "quantize_linears")  # a shard of a weight cannot be quantized
    only = None if blocks is None else frozenset(blocks)
    names = [n for n in fp8_linear_names(transformer) if only is None or int(n.split(".")[1]) in only]
    fp32, cast = _fp32_dtypes(transformer)
    kept = dict(kept_other=_KEPT[type(transformer).__name__], kept_fp32=fp32, cast_fp32=cast)
    if precision == "bf16":
        return _unquantized(fast_accum, fuse_swiglu, fuse_adaln, kept)
    summary = _quantize(transformer, names, only, emulate=emulate, fast_accum=fast_accum,
                        fuse_swiglu=fuse_swiglu, fuse_adaln=fuse_adaln, kept=kept)
    logger.log(logging.INFO if only is None else logging.DEBUG, "quantize_linears: %s",
               summary.describe())
    return summary


def _quantize(transformer: nn.Module, names: list[str], only: frozenset[int] | None, *,
              emulate: bool, fast_accum: bool, fuse_swiglu: bool | str, fuse_adaln: bool | str,
              kept: dict[str, object]) -> LinearQuantization:
    """:func:`quantize_linears` at "fp8" on the linears ``names`` of the blocks ``only``: checks
    them, the device and the fusions first, then swaps and fuses; returns the summary."""
    if not names:
        raise ValueError(f"blocks={sorted(only or ())} selects no block of "
                         f"{len(transformer.transformer_blocks)}")
    _check_targets(transformer, names)
    device = transformer.get_submodule(names[0]).weight.device
    config = None if emulate else _torchao_config(device, fast_accum)
    swiglu = [] if fuse_swiglu is False else swiglu_blocks(transformer, fuse_swiglu is True, emulate, device, only)
    adaln = [] if fuse_adaln is False else adaln_blocks(transformer, fuse_adaln is True, emulate, device, only)
    before = sum(_bytes(transformer.get_submodule(n)) for n in names)
    _swap(transformer, names, config)
    after = sum(_bytes(transformer.get_submodule(n)) for n in names)
    fused = fuse_swiglu_ffns(swiglu, fast_accum) if swiglu else ()
    adaln_names = fuse_adaln_blocks(adaln, fast_accum) if adaln else ()
    return LinearQuantization(
        precision="fp8", kernel="emulated" if emulate else "torchao",
        layers=_fused_names(names, fused), bytes_before=before, bytes_after=after,
        fast_accum=fast_accum, fused_ffns=fused, fused_adaln=adaln_names, **kept)


def _check_options(precision, emulate, fast_accum, fuse_swiglu, fuse_adaln) -> None:
    """:func:`quantize_linears`' option values (ValueError for ``precision``, TypeError for the
    flags), in that order, before anything is read from the transformer."""
    if precision not in LINEAR_PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of "
                         f"{', '.join(map(repr, LINEAR_PRECISIONS))}")
    for name, flag in (("emulate", emulate), ("fast_accum", fast_accum)):
        if not isinstance(flag, bool):  # "no" is truthy: it would have turned the option on
            raise TypeError(f"{name}={flag!r} must be True or False")
    for name, flag in (("fuse_swiglu", fuse_swiglu), ("fuse_adaln", fuse_adaln)):
        if not isinstance(flag, bool) and flag != "auto":
            raise TypeError(f"{name}={flag!r} must be True, False or 'auto'")


def _unquantized(fast_accum: bool, fuse_swiglu: bool | str, fuse_adaln: bool | str,
                 kept: dict[str, object]) -> LinearQuantization:
    """The summary of ``precision="bf16"`` (nothing changed), logged at INFO with the options
    passed as True that have nothing to act on."""
    summary = LinearQuantization(precision="bf16", kernel="none", layers=(), bytes_before=0,
                                 bytes_after=0, fast_accum=fast_accum, **kept)
    # a config passes these straight through; at bf16 they have nothing to act on
    unused = [f"{k}={v!r}" for k, v in (("fast_accum", fast_accum), ("fuse_swiglu", fuse_swiglu),
                                       ("fuse_adaln", fuse_adaln)) if v is True]
    logger.info("quantize_linears: %s%s", summary.describe(),
                f" ({', '.join(unused)}: no effect without FP8)" if unused else "")
    return summary


def _torchao_config(device: torch.device, fast_accum: bool) -> object:
    """torchao's FP8 config for weights on ``device``: RuntimeError where that device cannot run
    FP8 GEMMs, ImportError naming the extra without torchao."""
    reason = fp8_unsupported_reason(device)
    if reason:
        raise RuntimeError(f"quantize_linears(precision='fp8'): {reason}. (Tests may pass "
                           "emulate=True: the same recipe in float32 emulation.)")
    return torchao_fp8_config(fast_accum=fast_accum)


def _swap(transformer: nn.Module, names: list[str], config: object | None) -> None:
    """Replaces the linears ``names``: by torchao's FP8 weights under ``config`` (their all-zero
    rows' scales fixed), or by :class:`EmulatedFp8Linear` when ``config`` is None; RuntimeError
    when torchao leaves one unquantized."""
    if config is None:
        for name in names:
            parent, _, child = name.rpartition(".")
            owner = transformer.get_submodule(parent)
            setattr(owner, child, EmulatedFp8Linear.from_linear(getattr(owner, child)))
        return
    from torchao.quantization import quantize_

    wanted = set(names)
    quantize_(transformer, config, filter_fn=lambda module, fqn: fqn in wanted)
    for name in names:
        w = transformer.get_submodule(name).weight
        if not hasattr(w, "qdata"):  # torchao skips a layer it cannot run, silently
            raise RuntimeError(f"torchao left {name} unquantized ({type(w).__name__})")
        fix_zero_rows(w.qdata, w.scale)


def _fused_names(names: list[str], fused: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` with a fused FFN's linears under their new names: the projection at
    ``<ff>.proj``, the down projection's FP8 weight held by the fused module ``<ff>`` itself."""
    renamed = {**{f"{ff}.net.0.proj": f"{ff}.proj" for ff in fused}, **{f"{ff}.net.2": ff for ff in fused}}
    return tuple(renamed.get(n, n) for n in names)
