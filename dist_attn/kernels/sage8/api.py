# SPDX-License-Identifier: Apache-2.0
"""Public entry points of the Sage8 kernels: 8-bit attention forward for Hopper.

What they compute: non-causal softmax(Q K^T * scale) V per head, each packed segment attending only
to itself, with the SageAttention-2 recipe (ideas from the papers; the code is this project's own):

* K is smoothed by subtracting its per-(segment, head) channel mean, into a private INT8 copy: the
  caller's K is never modified (sageattention 1.0.6 does ``k -= k.mean()`` in place);
* Q is quantized to INT8 with one scale per row, K with one scale per key block of 128; both scales
  and ``softmax_scale * log2(e)`` fold into one factor per (row, block) applied to int32 scores;
* online softmax in exp2 with fp32 statistics; P and V in FP8 e4m3 (V with one scale per channel),
  P V accumulated in fp32.

Three implementations of the attention loop share the quantization pre-pass (:mod:`.quant`):
``impl="triton"`` (:mod:`.attn_triton`, also runs under Triton's CPU interpreter),
``impl="gluon"``, warp-specialized in Gluon (:mod:`.attn_gluon`), and ``impl="cute"``,
warp-specialized in CuTe DSL (:mod:`.attn_cute`, extra ``cute``); the last two need compute
capability 9.0.

Importing this module never imports triton: the kernels load on their first call.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from dist_attn.validation import check_qkv, check_softmax_scale

__all__ = [
    "DEFAULT_IMPL",
    "IMPLS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "interpreting",
    "sage8_dense",
    "sage8_varlen",
    "unsupported_reason",
]

#: head_dim values the kernels are compiled for (the INT8 -> float trick needs D * 127**2 < 2**22).
SUPPORTED_HEAD_DIMS = (64, 128)
#: input/output dtypes; the output has q's dtype.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: the attention loops; all read the same quantized operands.
IMPLS = ("gluon", "triton", "cute")
#: what the entry points run when ``impl`` is not given.
DEFAULT_IMPL = "triton"


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _gluon_missing() -> str | None:
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return "this triton has no Gluon (triton.experimental.gluon): use impl='triton' / backend 'sage8'"
    return None


#: the opt-in the CuTe DSL loop needs while it is no faster than the Triton loop (:func:`_cute_missing`)
CUTE_OPT_IN = "DIST_ATTN_SAGE8_CUTE"


def _cute_missing() -> str | None:
    from dist_attn.extras import install_hint
    if os.environ.get(CUTE_OPT_IN) != "1":
        return (f"the CuTe DSL loop (backend 'sage8_cute') is opt-in: it passes the GPU tests but "
                f"measured level with the Triton loop (docs/kernels.md); set {CUTE_OPT_IN}=1 to run "
                f"it (it is the 8-bit kernel that runs inside a ring), or use backend 'sage8'")
    if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("cutlass.cute") is None:
        return (f"the CuTe DSL loop (backend 'sage8_cute') needs CuTe DSL (nvidia-cutlass-dsl, for "
                f"a CUDA 13 torch): {install_hint('cute')}")
    return None


def unsupported_reason(q: torch.Tensor, impl: str = DEFAULT_IMPL) -> str | None:
    """Why the Sage8 kernel ``impl`` cannot run on tensors like ``q``, or None if it can.

    Args:
        q: a query tensor whose device, dtype and last dimension (head_dim) are checked.
        impl: ``"gluon"``, ``"triton"`` or ``"cute"``.

    Returns:
        None when triton imports, q is fp16/bf16 with head_dim 64 or 128, and q lives on a CUDA
        device of compute capability 9.0 (the Triton loop also on the CPU with
        ``TRITON_INTERPRET=1``); otherwise one sentence saying what is missing and how to fix it.
    """
    if impl not in IMPLS:
        return f"impl={impl!r} is not one of {IMPLS}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not importable: install it (pip install triton) to use the sage8 kernels."
    # The device first: on a machine that cannot run the kernel at all, the dtype and head size
    # are not what a user has to fix (a diffusers user met them first, then the GPU).
    if impl == "gluon" and q.device.type != "cuda":
        # Said before Gluon's presence and whatever TRITON_INTERPRET says: nothing runs this
        # loop off a GPU, and the way out is the other backend.
        return (f"the Gluon loop (backend 'sage8_gluon') needs a CUDA GPU of compute capability "
                f"9.0 (q is on {q.device}); Triton's interpreter cannot run it (warp "
                "specialization, TMA and wgmma have no CPU emulation). Without a GPU use backend "
                "'sage8' (impl='triton' for the kernel entry points) on CPU tensors, with "
                "TRITON_INTERPRET=1 set before triton is imported.")
    if impl == "cute" and q.device.type != "cuda":
        return (f"the CuTe DSL loop (backend 'sage8_cute') needs a CUDA GPU of compute capability 9.0 "
                f"(q is on {q.device}); it has no CPU emulation: without a GPU use backend 'sage8' "
                "under TRITON_INTERPRET=1, or 'sdpa'.")
    if q.device.type == "cuda":
        cc = torch.cuda.get_device_capability(q.device)
        if cc != (9, 0):
            return (f"sage8 is tuned for Hopper (compute capability 9.0) and uses its FP8/INT8 wgmma; "
                    f"this GPU is {cc[0]}.{cc[1]}: use another attention backend.")
    elif not (q.device.type == "cpu" and interpreting()):
        return (f"sage8 needs a CUDA GPU of compute capability 9.0 (q is on {q.device}); on the CPU its "
                "Triton loop runs only under Triton's interpreter: set TRITON_INTERPRET=1 before importing triton.")
    missing = _gluon_missing() if impl == "gluon" else _cute_missing() if impl == "cute" else None
    if missing is not None:
        return missing
    if q.dtype not in SUPPORTED_DTYPES:
        return (f"sage8 takes float16 or bfloat16 inputs, got {q.dtype}: cast q, k and v (a "
                "diffusers model: load or .to() it in torch.bfloat16).")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return (f"sage8 supports head_dim {SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}: use another "
                "attention backend for this head size.")
    return None


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """A [T, H, D] view of a [B, T, H, D] tensor with the same per-row metadata (for check_qkv)."""
    if t.shape[0] > 0:
        return t[0]
    # no batch element to view: a zero-copy stand-in of the same shape, dtype, device, strides
    return t.new_empty((1, 1, t.shape[-1])).expand(t.shape[1:])


def _check_inputs(q, k, v, *, batched: bool, impl: str) -> None:
    """Kernel-specific checks; the generic q/k/v rules are :func:`dist_attn.validation.check_qkv`'s."""
    ndim = 4 if batched else 3
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims ({'[B, T, H, D]' if batched else '[T, H, D]'}), "
                             f"got shape {tuple(t.shape)}")
    if batched:
        if not q.shape[0] == k.shape[0] == v.shape[0]:
            raise ValueError(f"q, k, v batch sizes must be equal, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
        check_qkv(*(_rows_view(t) for t in (q, k, v)))
    else:
        check_qkv(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:  # the kernels' 16-byte row loads; check_qkv admits a size-1 head_dim
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    reason = unsupported_reason(q, impl)
    if reason is not None:
        raise RuntimeError(reason)


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} of {q.dtype} on {q.device} with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype} {out.device} strides {out.stride()}")


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    check_softmax_scale(softmax_scale)  # the library's one rule (0 or < 0 breaks the softmax)
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def sage8_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                softmax_scale: float | None = None, out: torch.Tensor | None = None,
                return_lse: bool = False, impl: str = DEFAULT_IMPL, config=None, quant_config=None,
                kv_len: int | None = None):
    """Non-causal 8-bit attention on batched inputs.

    Args:
        q, k, v: ``[B, T, H, D]`` float16/bfloat16, same shape and device; any strides with
            ``stride(-1) == 1`` (no copy is made). Not modified.
        softmax_scale: multiplies Q K^T; default ``1 / sqrt(D)``.
        out: optional ``[B, T, H, D]`` destination of q's dtype (strided views allowed, last dim
            contiguous), e.g. the Ulysses output send buffer: saves a copy of the result.
        return_lse: also return the log-sum-exp of each row's scaled scores.
        impl: ``"triton"``, ``"gluon"`` or ``"cute"`` (see the module docstring).
        config: the implementation's launch config (``attn_triton.TritonConfig`` /
            ``attn_gluon.GluonConfig`` / ``attn_cute.CuteConfig``); None = the defaults.
        quant_config: the pre-pass options (``quant.QuantConfig``); None = the defaults.
        kv_len: attend only keys ``[0, kv_len)`` (``impl="cute"`` only; 1 <= kv_len <= T): how
            a query chunk meets a shorter key chunk (the ring), both padded to T rows by the caller.

    Returns:
        ``out`` (or a fresh contiguous ``[B, T, H, D]`` tensor of q's dtype); with ``return_lse``
        the pair ``(out, lse)``, lse ``[B, H, T]`` float32, natural log of ``sum_j exp(scale q.k_j)``.
    """
    _check_inputs(q, k, v, batched=True, impl=impl)
    B, T, H, D = q.shape
    if kv_len is not None and (impl != "cute" or not 1 <= int(kv_len) <= T):
        raise ValueError(f"kv_len={kv_len!r} needs impl='cute' (got {impl!r}) and 1 <= kv_len <= T={T}")
    if out is None:
        out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    else:
        _check_out(out, q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device) if return_lse else None
    if B and T and H:
        from dist_attn.kernels.sage8 import launch
        layout = launch.dense_layout(B, T, kv_len=kv_len)
        launch.forward(q, k, v, out, lse, layout=layout, softmax_scale=_scale(softmax_scale, D), impl=impl,
                       config=config, quant_config=quant_config, interpret=interpreting())
    return (out, lse) if return_lse else out


def sage8_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int, *, used: int | None = None, softmax_scale: float | None = None,
                 out: torch.Tensor | None = None, return_lse: bool = False, impl: str = DEFAULT_IMPL,
                 config=None, quant_config=None):
    """Non-causal 8-bit attention on packed segments, in one launch and without any host sync.

    Args:
        q, k, v: ``[T, H, D]`` float16/bfloat16, rows of all segments packed; any strides with
            ``stride(-1) == 1`` (e.g. Ulysses receive-buffer views with strides (3*H*D, D, 1)).
            Not modified.
        cu_seqlens: ``[S + 1]`` int32/int64 on q's device, non-decreasing offsets; segment ``s`` is
            rows ``[cu_seqlens[s], cu_seqlens[s+1])`` and attends only to itself. Empty segments
            are fine. The segments must cover ``[0, used)``: rows outside every segment are not
            written.
        max_seqlen: host int >= the longest segment (sizes the grid; never read from the device).
        used: rows ``[used, T)`` are trailing padding: not read, returned as exact zeros (and an
            LSE of -inf). Segments are clipped to ``[0, used)``. Default ``T``.
        softmax_scale: multiplies Q K^T; default ``1 / sqrt(D)``.
        out: optional ``[T, H, D]`` destination of q's dtype (strided views allowed, last dim
            contiguous); written and returned.
        return_lse: also return the LSE, ``[H, T]`` float32.
        impl, config, quant_config: as for :func:`sage8_dense`.

    Returns:
        ``out`` (or a fresh ``[T, H, D]`` tensor of q's dtype); with ``return_lse``, ``(out, lse)``.
    """
    _check_inputs(q, k, v, batched=False, impl=impl)
    T, H, D = q.shape
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device} (no host copy is made), got "
                         f"{cu_seqlens.device}")
    used = T if used is None else int(used)
    if not 0 <= used <= T:
        raise ValueError(f"used={used} must lie in [0, T={T}]")
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    else:
        _check_out(out, q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device) if return_lse else None
    if used < T:
        out[used:].zero_()
        if lse is not None:
            lse[:, used:] = float("-inf")
    nseg = cu_seqlens.numel() - 1
    if nseg and used and max_seqlen > 0 and H:
        from dist_attn.kernels.sage8 import launch
        layout = launch.varlen_layout(cu_seqlens, T, used, int(max_seqlen))
        launch.forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                       None if lse is None else lse.unsqueeze(0), layout=layout,
                       softmax_scale=_scale(softmax_scale, D), impl=impl, config=config,
                       quant_config=quant_config, interpret=interpreting())
    return (out, lse) if return_lse else out

