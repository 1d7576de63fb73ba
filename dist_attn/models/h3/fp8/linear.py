# SPDX-License-Identifier: Apache-2.0
"""FP8 linear layers: one numeric recipe, run by torchao on a GPU or emulated in float32.

The recipe is torchao's float8 inference with per-row scales
(``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``), which calls
``torch._scaled_mm`` (cuBLASLt / CUTLASS on compute capability >= 8.9). For a weight ``W [N, K]``
(bf16) and an activation ``x [M, K]`` (bf16), with ``e4m3(t) = t.to(torch.float8_e4m3fn)``
(round to nearest even) and 448 the largest e4m3 value:

    s_w[n] = fp32(bf16(max_k |W[n, k]|) / 448)                 once, per output channel
    W8     = e4m3(clamp(fp32(W) / s_w, -448, 448))
    s_x[m] = fp32(bf16(max(max_k |x[m, k]|, 1e-12)) / 448)     every call, per row
    x8     = e4m3(clamp(fp32(x) / s_x, -448, 448))
    y[m, n] = bf16((sum_k fp32(x8[m, k]) * fp32(W8[n, k])) * s_x[m] * s_w[n])

The scales are divided in the activation's dtype (bf16) before the cast to float32, as torchao's
``_choose_scale_float8`` does; the products of two e4m3 values are exact in float32 and the sum is
accumulated in float32 (``use_fast_accum=False``: Hopper's fast FP8 accumulation keeps fewer bits
of a long sum; docs/diffusers.md, FP8 linears, has the measured error). Two guards
that torchao lacks: an all-zero activation row would get scale 0 and 0/0 = NaN codes (padding rows
of an attention output are exactly zero), so the row maximum is floored at 1e-12 (torchao's
``activation_value_lb``); an all-zero weight row gets scale 1 and zero codes.

:func:`fp8_linear_emulated` computes the recipe in float32 on any device; it exists to pin the
numerics in CPU tests (:class:`EmulatedFp8Linear`) and is never chosen automatically.
:func:`fp8_unsupported_reason` says why a device cannot run the real thing.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import nn

from dist_attn.extras import install_hint
from dist_attn.models.h3.fp8.numerics import (ACTIVATION_AMAX_FLOOR, ADALN_MAX_HIDDEN, E4M3_MAX,
                                              SWIGLU_MAX_INNER)
from dist_attn.weight_sharding import register_fp8_linear

__all__ = [
    "ACTIVATION_AMAX_FLOOR",
    "ADALN_MAX_HIDDEN",
    "E4M3_MAX",
    "FP8_EXTRA",
    "FP8_MIN_CAPABILITY",
    "LINEAR_PRECISIONS",
    "EmulatedFp8Linear",
    "Fp8Linear",
    "Fp8Rows",
    "Fp8SwiGLUFeedForward",
    "SWIGLU_MAX_INNER",
    "LinearPrecision",
    "QuantizedTensors",
    "fix_zero_rows",
    "fused_input_dtype_error",
    "fp8_linear_emulated",
    "fp8_rows_matmul",
    "fp8_unsupported_reason",
    "quantize_rows_e4m3",
    "quantize_weight_e4m3",
    "require_torchao",
    "torchao_fp8_config",
]

#: Precision of a model's quantizable linear layers: "bf16" leaves them in the blocks' dtype
#: (bfloat16 on CUDA), "fp8" is this module's recipe.
LinearPrecision = Literal["bf16", "fp8"]
LINEAR_PRECISIONS: tuple[str, ...] = get_args(LinearPrecision)
#: ``torch._scaled_mm`` with e4m3 operands needs Ada (8.9), Hopper (9.0) or newer.
FP8_MIN_CAPABILITY = (8, 9)
#: The command that installs torchao (the ``fp8`` extra).
FP8_EXTRA = install_hint("fp8")


def quantize_rows_e4m3(x: torch.Tensor, *, amax_floor: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes and scales, as torchao's ``Float8Tensor.from_hp(granularity=PerRow())``.

    Args:
        x: ``[..., K]`` bf16 (or any float dtype: the scale is divided in x's dtype).
        amax_floor: lower bound of each row's max |x| (None: none, as torchao for weights).

    Returns:
        ``codes [..., K]`` float8_e4m3fn and ``scales [..., 1]`` float32, with
        ``x ~= codes.float() * scales``.
    """
    amax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1] in x's dtype
    if amax_floor is not None:
        amax = amax.clamp(min=amax_floor)
    scales = (amax / E4M3_MAX).to(torch.float32)  # divided in x's dtype first, as torchao does
    codes = (x.to(torch.float32) / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def quantize_weight_e4m3(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight's codes and per-output-channel scales, zero rows made harmless.

    Args:
        weight: ``[N, K]`` (bf16 for torchao's per-row recipe).

    Returns:
        ``codes [N, K]`` float8_e4m3fn and ``scales [N, 1]`` float32; an all-zero row gets scale 1
        and zero codes (torchao alone would store 0/0 = NaN codes for it).
    """
    codes, scales = quantize_rows_e4m3(weight)
    return fix_zero_rows(codes, scales)


def fix_zero_rows(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose scale is 0 (an all-zero weight row): scale 1 and zero codes, in place.

    Args:
        codes: ``[N, K]`` float8_e4m3fn; scales: ``[N, 1]`` float32.
    """
    zero = scales == 0  # [N, 1]
    if bool(zero.any()):
        scales.masked_fill_(zero, 1.0)
        codes.view(torch.uint8).masked_fill_(zero, 0)  # e4m3 +0.0 is the all-zero byte
    return codes, scales


class Fp8Rows(NamedTuple):
    """An activation already quantized by the recipe: what an FP8 linear of this module takes in
    place of the bf16 tensor it would quantize itself (:class:`Fp8Linear`,
    :class:`EmulatedFp8Linear`, :class:`Fp8SwiGLUFeedForward`), so that the pass producing the
    activation can quantize it (:func:`dist_attn.models.h3.fp8.adaln_kernel.adaln_e4m3_rows`)."""

    codes: torch.Tensor
    """``[..., K]`` float8_e4m3fn."""
    scales: torch.Tensor
    """``[..., 1]`` float32: the row ``x ~= codes.float() * scales``."""


def fp8_rows_matmul(rows: Fp8Rows, weight_codes: torch.Tensor, weight_scales: torch.Tensor,
                    bias: torch.Tensor | None = None, *, out_dtype: torch.dtype,
                    fast_accum: bool = False, emulate: bool = False) -> torch.Tensor:
    """``y = x W^T (+ b)`` from quantized rows: ``torch._scaled_mm`` on CUDA, the recipe's float32
    emulation with ``emulate`` or off CUDA (the module docstring's epilogue either way; the
    emulation ignores ``fast_accum``).

    Args:
        rows: ``codes [..., K]`` and ``scales [..., 1]``.
        weight_codes: ``[N, K]`` float8_e4m3fn; weight_scales: ``N`` float32 scales, ``[N, 1]``
            or ``[1, N]``.
        bias: ``[N]`` or None; out_dtype: the result's dtype; fast_accum: ``use_fast_accum``;
        emulate: float32 emulation on any device.

    Returns:
        ``[..., N]`` in ``out_dtype``.
    """
    codes, scales = rows
    k, n = codes.shape[-1], weight_codes.shape[0]
    a, sa, sw = codes.reshape(-1, k), scales.reshape(-1, 1), weight_scales.reshape(1, n)
    if a.is_cuda and not emulate:
        y = torch._scaled_mm(a, weight_codes.t(), scale_a=sa, scale_b=sw, bias=bias,
                             out_dtype=out_dtype, use_fast_accum=fast_accum)
    else:
        y = (a.to(torch.float32) @ weight_codes.to(torch.float32).t()) * sa * sw  # fp32 accumulate
        if bias is not None:
            y = y + bias.to(torch.float32)
        y = y.to(out_dtype)
    return y.reshape(*codes.shape[:-1], n)


def fp8_linear_emulated(x: torch.Tensor, weight_codes: torch.Tensor, weight_scales: torch.Tensor,
                        bias: torch.Tensor | None = None, *,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x W^T (+ b)`` by the module's recipe, computed in float32 (see the module docstring).

    Args:
        x: ``[..., K]`` activations (bf16 in the served model); quantized per row here.
        weight_codes: ``[N, K]`` float8_e4m3fn; weight_scales: ``[N, 1]`` float32
            (:func:`quantize_weight_e4m3`).
        bias: ``[N]`` or None, added in float32 after the scales (H3's block linears have none).
        out_dtype: dtype of the result (``torch._scaled_mm``'s ``out_dtype``); None: x's dtype.

    Returns:
        ``[..., N]`` in ``out_dtype``.
    """
    rows = Fp8Rows(*quantize_rows_e4m3(x, amax_floor=ACTIVATION_AMAX_FLOOR))
    return fp8_rows_matmul(rows, weight_codes, weight_scales, bias, out_dtype=out_dtype or x.dtype,
                           emulate=True)


def fused_input_dtype_error(got: str, fused: str, option: str) -> ValueError:
    """The error of a module fused by ``quantize_linears(option=...)`` handed a non-bf16 input,
    which a model cast after quantizing does (the kernel's own message names neither): ``got``
    says what came in, ``fused`` what was fused (e.g. "an FFN")."""
    return ValueError(f"{got}: {fused} fused by quantize_linears({option}=True or 'auto') takes "
                      "bfloat16; was the model cast after quantize_linears? Keep the blocks in "
                      f"bfloat16, or quantize a fresh model with {option}=False")


class QuantizedTensors(nn.Module):
    """A module whose e4m3 codes and float32 scales keep their dtype through ``.to(dtype)``,
    ``.half()`` or ``.bfloat16()``: those casts move them to the new device but never re-round
    them (float8 counts as floating point, so ``nn.Module.to`` would cast the codes to bf16, and
    bf16 scales would lose bits). Other parameters (a bias) follow the cast as usual.

    The codes and scales are buffers, or frozen parameters of the same names once
    :func:`dist_attn.weight_sharding.shard_module` has made them shardable: :attr:`quantized`
    names them either way (the library's
    :class:`~dist_attn.weight_sharding.HoldsQuantizedTensors`)."""

    def __init__(self) -> None:
        super().__init__()
        self.quantized: tuple[str, ...] = ()
        """Names of the codes and scales (set by each subclass)."""

    def _apply(self, fn, recurse=True):
        before = {name: t for name in self.quantized
                  if (t := self._buffers.get(name, self._parameters.get(name))) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            store = self._buffers if name in self._buffers else self._parameters
            new = store[name]
            if new is not None and new.dtype != old.dtype:
                kept = old.to(device=new.device)
                store[name] = nn.Parameter(kept, requires_grad=False) if store is self._parameters else kept
        return self


class EmulatedFp8Linear(QuantizedTensors):
    """An ``nn.Linear`` replaced by the FP8 recipe in float32 emulation (tests and CPU checks).

    Holds the weight's e4m3 codes (``weight_codes [N, K]``) and scales (``weight_scales [N, 1]``)
    as buffers and the bias as it was; the original weight is dropped, as with torchao.
    """

    def __init__(self, weight_codes: torch.Tensor, weight_scales: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_codes.shape
        self.register_buffer("weight_codes", weight_codes)
        self.register_buffer("weight_scales", weight_scales)
        self.quantized = ("weight_codes", "weight_scales")
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "EmulatedFp8Linear":
        """Quantizes ``linear.weight`` (see :func:`quantize_weight_e4m3`)."""
        codes, scales = quantize_weight_e4m3(linear.weight.detach())
        return cls(codes, scales, linear.bias)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` in x's dtype (bf16 for
        :class:`Fp8Rows`, whose quantization is already done)."""
        if isinstance(x, Fp8Rows):
            return fp8_rows_matmul(x, self.weight_codes, self.weight_scales, self.bias,
                                   out_dtype=torch.bfloat16, emulate=True)
        return fp8_linear_emulated(x, self.weight_codes, self.weight_scales, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8=e4m3 per-row (float32 emulation)")


class Fp8Linear(QuantizedTensors):
    """A bias-free FP8 linear of the recipe on CUDA that also takes :class:`Fp8Rows`.

    torchao's FP8 ``nn.Linear`` quantizes its bf16 input itself; this one holds the same e4m3
    weight (``weight_codes [N, K]``, ``weight_scales [1, N]``: torchao's ``qdata`` and ``scale``,
    shared, not copied) and, given a bf16 tensor, quantizes it by the same recipe
    (:func:`quantize_rows_e4m3`, then ``torch._scaled_mm``), or, given :class:`Fp8Rows`, runs only
    the GEMM. :func:`dist_attn.models.h3.fp8.quantize_linears` puts it where the
    activation's producer quantizes (``fuse_adaln``).
    """

    def __init__(self, weight_codes: torch.Tensor, weight_scales: torch.Tensor, *, fast_accum: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_codes.shape
        self.register_buffer("weight_codes", weight_codes)
        self.register_buffer("weight_scales", weight_scales.reshape(1, -1))  # [1, N], as _scaled_mm takes
        self.quantized = ("weight_codes", "weight_scales")
        self.fast_accum = fast_accum

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """``[..., in_features]`` (bf16, or its rows already quantized) -> ``[..., out_features]``
        bf16."""
        if not isinstance(x, Fp8Rows):
            x = Fp8Rows(*quantize_rows_e4m3(x, amax_floor=ACTIVATION_AMAX_FLOOR))
        return fp8_rows_matmul(x, self.weight_codes, self.weight_scales, out_dtype=torch.bfloat16,
                               fast_accum=self.fast_accum)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias=False, "
                f"fast_accum={self.fast_accum}, fp8=e4m3 per-row, takes Fp8Rows")


# shard_module puts this module in place of each torchao FP8 linear (the same codes and recipe)
register_fp8_linear(Fp8Linear)


class Fp8SwiGLUFeedForward(QuantizedTensors):
    """A SwiGLU feed-forward whose two linears are FP8 (the recipe above), with the SwiGLU and the
    quantization of its output in one kernel
    (:func:`dist_attn.models.h3.fp8.swiglu_kernel.swiglu_e4m3_rows`).

    ``forward(x) = down(value * silu(gate))`` with ``[value, gate] = proj(x)``, as diffusers'
    ``FeedForward(activation_fn="swiglu")``; the down projection is ``torch._scaled_mm`` on the
    kernel's codes and row scales. Its output is the same FFN with a torchao FP8 down projection
    (the same recipe and GEMM; on the GPU the kernel's fast exponential may move a code by one
    e4m3 step, its division by the scale is exact; tests/integrations/test_fp8_gpu.py bounds how
    often): one pass over the FFN's projection is saved.

    Args:
        proj: the input projection ``[*, K] -> [*, 2I]`` (a torchao FP8 ``nn.Linear``, or an
            :class:`Fp8Linear` where the block's AdaLN input arrives quantized), kept as is.
        down_codes: ``[N, I]`` float8_e4m3fn and ``down_scales``: ``[N, 1]`` float32, the down
            projection's weight (:func:`quantize_weight_e4m3`, or torchao's ``qdata`` / ``scale``).
        fast_accum: ``use_fast_accum`` of the down projection's ``torch._scaled_mm``.
    """

    def __init__(self, proj: nn.Module, down_codes: torch.Tensor, down_scales: torch.Tensor, *,
                 fast_accum: bool) -> None:
        super().__init__()
        self.proj = proj
        self.register_buffer("down_codes", down_codes)
        self.register_buffer("down_scales", down_scales.reshape(1, -1))  # [1, N], as _scaled_mm takes
        self.quantized = ("down_codes", "down_scales")
        self.fast_accum = fast_accum

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """``[..., K]`` bf16 (or its rows quantized, when ``proj`` takes :class:`Fp8Rows`) ->
        ``[..., N]`` bf16."""
        from dist_attn.models.h3.fp8.swiglu_kernel import swiglu_e4m3_rows  # imports triton

        lead = (x.codes if isinstance(x, Fp8Rows) else x).shape[:-1]
        h = self.proj(x)
        if h.dtype != torch.bfloat16:
            raise fused_input_dtype_error(f"the FFN's projection gave {h.dtype}", "an FFN", "fuse_swiglu")
        codes, scales = swiglu_e4m3_rows(h)  # [M, I] e4m3, [M, 1] float32
        y = torch._scaled_mm(codes, self.down_codes.t(), scale_a=scales, scale_b=self.down_scales,
                             out_dtype=torch.bfloat16, use_fast_accum=self.fast_accum)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        n, i = self.down_codes.shape
        return (f"inner={i}, out_features={n}, fast_accum={self.fast_accum}, "
                "SwiGLU + e4m3 row quantization fused")


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """Why FP8 linears cannot run on ``device`` (None: they can, torchao permitting).

    CPU is refused although ``torch._scaled_mm`` exists there: torchao's recipe refuses it, and
    oneDNN dequantizes to float32 before its GEMM, so it would be slower than bf16 and gain
    nothing; :class:`EmulatedFp8Linear` is the explicit CPU path for tests.
    """
    device = torch.device(device)
    want = ".".join(map(str, FP8_MIN_CAPABILITY))
    if device.type != "cuda":
        return (f"device {device} has no FP8 matrix multiply (torch._scaled_mm with e4m3 "
                f"operands needs a CUDA GPU of compute capability >= {want}: Ada, Hopper or "
                "newer)")
    if not torch.cuda.is_available():
        return f"device {device}: CUDA is not available in this process"
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return (f"device {device} ({torch.cuda.get_device_name(index)}) has compute capability "
                f"{capability[0]}.{capability[1]}; FP8 matrix multiplies need >= {want}")
    return None


def require_torchao() -> Any:
    """The ``torchao`` module; an ImportError that names the extra when it is not installed."""
    try:
        return importlib.import_module("torchao")
    except ImportError as e:
        raise ImportError(f"FP8 linear layers run torchao's float8 inference, and torchao is not "
                          f"installed ({e}): {FP8_EXTRA} (torchao>=0.17)") from e


def torchao_fp8_config(*, fast_accum: bool = False) -> Any:
    """torchao's config for the recipe: e4m3 activations and weights, per-row scales, the
    activation floor, ``use_fast_accum=fast_accum``. ``kernel_preference=TORCH``: torch's own
    quantizer and ``torch._scaled_mm``, whatever else is installed (with the optional ``mslk``
    package torchao's AUTO would switch to its Triton quantizer and CUTLASS GEMM: another recipe,
    unmeasured here). ``set_inductor_config=False``: torchao would otherwise switch on
    coordinate-descent tuning for the whole process (longer compiles, other models affected)."""
    require_torchao()
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8MMConfig,
                                      PerRow)
    from torchao.quantization.quantize_.common import KernelPreference

    return Float8DynamicActivationFloat8WeightConfig(
        activation_dtype=torch.float8_e4m3fn, weight_dtype=torch.float8_e4m3fn,
        granularity=PerRow(), mm_config=Float8MMConfig(use_fast_accum=fast_accum),
        activation_value_lb=ACTIVATION_AMAX_FLOOR, kernel_preference=KernelPreference.TORCH,
        set_inductor_config=False)
