# SPDX-License-Identifier: Apache-2.0
"""Single-GPU attention kernels at the h3-ref per-rank shapes: speed, error vs float64, bridge overhead.

Shapes ("h3-ref", one H3 denoise step): per Ulysses rank with degree W, all 38,016 packed rows and 56/W
heads of 128, bf16, non-causal; the packed layout is one document padded at the end,
cu_seqlens = (0, 37,980, 38,016).

Kernels (``--kernels`` takes comma-separated fnmatch patterns of these names):

=====================  ========================================================  ==============
name                   call                                                      N in TFLOP/s
=====================  ========================================================  ==============
sdpa_cudnn             torch SDPA under sdpa_kernel(CUDNN_ATTENTION), all rows   total (38,016)
sdpa_flash             torch SDPA under sdpa_kernel(FLASH_ATTENTION), all rows   total
sage_dense             sageattention.core.sageattn, NHD, K = a scratch clone     total
sage_varlen            sageattention.core.sageattn_varlen at (0, used, total)    used (37,980)
sage2_direct           SageAttention 2's sm90 kernel (built from source),        total
                       sageattn_qk_int8_pv_fp8_cuda_sm90, per_warp, fp32+fp32
sage2_quant            sage2_direct's quantization alone (K mean, per_warp INT8,  total
                       V padded and per-channel FP8): timed, no output
sage2_attn             sage2_direct's sm90 kernel alone, operands quantized       total
                       outside the timed region
quant:<b>              sage8 / sage8_gluon's pre-pass alone (quant.quantize)      total
attn:<b>               sage8 / sage8_gluon's attention loop alone, operands       total
                       quantized outside the timed region
fa3_fp8                FA3 FP8 (fa3-fwd wheel), per-head e4m3 quantization in    total
                       plain torch counted in the time
fa3_fp8_prequant       FA3 FP8 on operands quantized outside the timed region    total
variant:<b>:<v>        sage8 / sage8_gluon dense with a non-default config:      total
                       v = v2-running (the v2 kernel: P V summed inside the FP8
                       MMA across the whole row), pv-first, stages2 (Gluon loop
                       orderings, attn_gluon.GluonConfig), 3stages-2cta
                       (the Triton loop's launch before 3 CTAs per SM),
                       kscale-pipelined (its K-scale load before the direct one),
                       bn64 / bn64-s3 (64-key blocks, 168 registers, 2 or 3
                       TMA stages), bm128 / bm128-r128 / bm128-s3 (128 query
                       rows and 8 warps a program: 168 or 128 registers, or
                       3 stages uncapped)
bridge:<backend>       dist_attn.sage_varlen(..., backend=<b>) at (0,used,total) used
dense:<backend>        get_backend(<b>).dense on all rows                        total
dense_used:<backend>   get_backend(<b>).dense on rows [0, used) (bridge baseline) used
=====================  ========================================================  ==============

``<backend>`` is every name of ``dist_attn.backends.available_backends()`` except "auto"
(sdpa, sage, sage8 = the Triton loop, sage8_gluon = the Gluon loop, fa3 = FA3 bf16, ...).
TFLOP/s-equivalent = 4 * N^2 * heads * D / time.

The bridge overhead row is ``bridge:<b> / dense_used:<b> - 1`` at the same heads: what the
packed-layout handling costs over a dense call on exactly the used rows (target <= 1%).

Errors are measured on a smaller shape (``--err-seq`` rows x ``--err-heads`` heads) against
attention computed in float64 on the same device from the same bf16 inputs, on N(0,1) data and
on N(0,1) with +0.5 added to k (a per-channel key bias, what Sage's K smoothing is for).

Examples::

    python -m benchmarks.kernels --smoke                      # CPU, seconds
    python -m benchmarks.kernels                              # one GPU, h3-ref
    python -m benchmarks.kernels --heads 14 --kernels 'sdpa_cudnn,*sage*' --iters 50
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

from benchmarks.harness import (
    H3_REF,
    Budget,
    ResultWriter,
    add_common_args,
    attention_tflops,
    describe_exception,
    markdown_table,
    time_fn,
)

import torch

import dist_attn
from dist_attn import backends as da_backends

THEME = "kernels"
_BUDGET_REASON = "skipped: the --budget-s wall-time budget was spent"


class Unavailable(Exception):
    """This kernel cannot run here; the message says why."""


@dataclass
class Layout:
    total: int
    used: int
    scale: float
    cu: torch.Tensor  # [3] int32 on the device: (0, used, total)
    cu_host: list[int]


@dataclass
class KernelSpec:
    name: str
    n_kind: str  # "total" or "used": which rows the TFLOP/s figure counts
    padded: bool  # output rows [used, total) belong to the padding segment
    build: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Layout], Callable[[], torch.Tensor]]
    what: str
    #: "whole" (returns the attention output) or one launch of a kernel alone ("quant", "attn"):
    #: timed only, never compared with float64
    part: str = "whole"


# ---------------------------------------------------------------------------------------------
# kernel builders: each returns a no-argument callable, or raises Unavailable(reason)
# ---------------------------------------------------------------------------------------------
def _sdpa(backend_name: str):
    def build(q, k, v, lay):
        if q.device.type != "cuda":
            raise Unavailable(f"SDPA {backend_name} backend needs a CUDA device (q is on {q.device})")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = getattr(SDPBackend, backend_name, None)
        if which is None:
            raise Unavailable(f"this torch has no SDPBackend.{backend_name}")
        # [T, H, D] -> [1, H, T, D] strided views, as the sdpa backend of the bridge passes them.
        qt, kt, vt = (t[None].transpose(1, 2) for t in (q, k, v))

        def run():
            with sdpa_kernel([which]):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=lay.scale)
            return out[0].transpose(0, 1)  # [1, H, T, D] -> [T, H, D] view, like every other row

        run()  # raises here (not mid-timing) when the backend refuses these inputs
        return run
    return build


def _sage_core():
    try:
        import sageattention.core as core
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"sageattention.core does not import ({describe_exception(exc)})") from None
    return core


def _sage_dense(q, k, v, lay):
    if q.device.type != "cuda":
        raise Unavailable(f"sageattention 1.0.6 needs CUDA tensors (q is on {q.device})")
    core = _sage_core()
    # sageattention 1.0.6 does `k -= k.mean(...)` IN PLACE (max |dK| 0.55 on N(0,1)+0.5 data,
    # measured on an H200): it gets a scratch clone, made here outside the timed region. Re-smoothing
    # an already-smoothed clone changes it only by rounding, so every timed call is alike.
    k_scratch = k.clone()

    def run():
        return core.sageattn(q[None], k_scratch[None], v[None], tensor_layout="NHD", is_causal=False,
                             sm_scale=lay.scale)[0]
    return run


def _sage_varlen(q, k, v, lay):
    if q.device.type != "cuda":
        raise Unavailable(f"sageattention 1.0.6 needs CUDA tensors (q is on {q.device})")
    core = _sage_core()
    if not hasattr(core, "sageattn_varlen"):
        raise Unavailable("this sageattention has no core.sageattn_varlen")
    k_scratch = k.clone()  # same in-place smoothing as the dense call
    max_seqlen = max(b - a for a, b in zip(lay.cu_host[:-1], lay.cu_host[1:]))

    def run():
        return core.sageattn_varlen(q, k_scratch, v, lay.cu, lay.cu, max_seqlen, max_seqlen,
                                    is_causal=False, sm_scale=lay.scale)
    return run


def _sage2_direct(q, k, v, lay):
    """SageAttention 2's own Hopper kernel as its users call it (quantization included): the peer
    that sage8 is measured against. Not on PyPI; build it from ../shared/third_party."""
    if q.device.type != "cuda":
        raise Unavailable(f"SageAttention 2's sm90 kernel needs a Hopper GPU (q is on {q.device})")
    try:
        import sageattention
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"sageattention does not import ({describe_exception(exc)})") from None
    fn = getattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda_sm90", None)
    if fn is None:
        raise Unavailable("this sageattention has no sageattn_qk_int8_pv_fp8_cuda_sm90 (PyPI has only 1.0.6; "
                          "build 2.x from source: benchmarks/README.md)")

    def run():
        return fn(q[None], k[None], v[None], tensor_layout="NHD", is_causal=False, qk_quant_gran="per_warp",
                  pv_accum_dtype="fp32+fp32", sm_scale=lay.scale)[0]
    run()
    return run


def _sage2_part(part: str):
    """SageAttention 2's two stages apart, with the arguments its ``sageattn_qk_int8_pv_fp8_cuda_sm90``
    passes them (NHD, per_warp, K smoothed, V padded to 128 keys): "quant" is its quantization
    alone, "attn" its sm90 kernel on operands quantized outside the timed region."""
    def build(q, k, v, lay):
        _sage2_direct(q, k, v, lay)  # raises Unavailable with the reason where it cannot run
        from sageattention import sm90_compile
        from sageattention.quant import per_channel_fp8, per_warp_int8

        qb, kb, vb = q[None], k[None], v[None]

        def quant():
            km = kb.mean(dim=1, keepdim=True)
            qi8, qs, ki8, ks = per_warp_int8(qb, kb, km, tensor_layout="NHD", BLKQ=64, WARPQ=16, BLKK=128)
            pad = (-vb.shape[1]) % 128
            vp = torch.cat([vb, vb.new_zeros(1, pad, *vb.shape[2:])], dim=1) if pad else vb
            v8, vs, _ = per_channel_fp8(vp, tensor_layout="NHD", smooth_v=False)
            return qi8, qs, ki8, ks, v8, vs
        if part == "quant":
            quant()
            return quant
        qi8, qs, ki8, ks, v8, vs = quant()
        out = torch.empty_like(qb)

        def run():
            # layout 0 = NHD, not causal, granularity 2 = per_warp, no LSE
            sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(
                qi8, ki8, v8, out, qs, ks, vs, 0, 0, 2, lay.scale, 0)
            return out[0]
        run()
        return run
    return build


def _sage8_part(backend: str, part: str):
    """sage8's two launches apart, default configs: "quant" is the pre-pass alone, "attn" the
    attention loop on operands quantized outside the timed region."""
    def build(q, k, v, lay):
        from dist_attn.kernels.sage8 import api, launch

        be = _backend_or_raise(backend, q)
        cfg = launch.default_config(be.impl)
        qb, kb, vb = q[None], k[None], v[None]
        layout = launch.dense_layout(1, q.shape[0])
        interp = api.interpreting()  # what the backend's own call does on a CPU under the interpreter

        def quant():
            return launch.prepare(qb, kb, vb, layout=layout, softmax_scale=lay.scale, impl=be.impl, config=cfg,
                                  interpret=interp)
        if part == "quant":
            quant()
            return quant
        qz, out, loop = quant(), torch.empty_like(qb), launch.attention_loop(be.impl, interpret=interp)

        def run():
            loop(qz, qb, out, None, lay.scale, cfg)
            return out[0]
        run()
        return run
    return build


def _fa3_fp8(prequant: bool):
    """FA3's FP8 forward with one scale per (batch, head) for each of q, k, v (what SGLang's FP8
    path does); ``prequant`` leaves the quantization out of the timed call."""
    def build(q, k, v, lay):
        if q.device.type != "cuda":
            raise Unavailable(f"FA3 needs a Hopper GPU (q is on {q.device})")
        try:
            import importlib
            config = importlib.import_module("fa3_fwd_config")
            sys.modules.setdefault("flash_attn_config", config)  # the interface imports this name
            fa3 = importlib.import_module("fa3_fwd_interface")
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"the fa3-fwd wheel does not import ({describe_exception(exc)})") from None
        fp8 = torch.float8_e4m3fn

        def quant(t):  # [T, H, D] -> ([1, T, H, D] e4m3, [1, H] fp32 descale)
            amax = t.abs().amax(dim=(0, 2)).float().clamp_min(1e-12)  # [H]
            scale = 448.0 / amax
            return (t.float() * scale[None, :, None]).to(fp8)[None], (1.0 / scale)[None].contiguous()

        def call(q8, k8, v8, dq, dk, dv):
            res = fa3.flash_attn_func(q8, k8, v8, softmax_scale=lay.scale, causal=False,
                                      q_descale=dq, k_descale=dk, v_descale=dv)
            out = res[0] if isinstance(res, tuple) else res
            return out[0]

        if prequant:
            (q8, dq), (k8, dk), (v8, dv) = (quant(t) for t in (q, k, v))
            run = lambda: call(q8, k8, v8, dq, dk, dv)  # noqa: E731
        else:
            def run():
                (q8, dq), (k8, dk), (v8, dv) = (quant(t) for t in (q, k, v))
                return call(q8, k8, v8, dq, dk, dv)
        run()  # raises here (not mid-timing) when the build refuses these inputs
        return run
    return build


def _backend_or_raise(name: str, q: torch.Tensor):
    try:
        be = da_backends.get_backend(name)
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(describe_exception(exc)) from None
    try:
        reason = be.unsupported_reason(q)
    except Exception as exc:  # noqa: BLE001
        reason = describe_exception(exc)
    if reason is not None:
        raise Unavailable(reason)
    return be


def _bridge(name: str):
    def build(q, k, v, lay):
        _backend_or_raise(name, q)

        def run():
            return dist_attn.sage_varlen(q, k, v, lay.cu, lay.used, cu_seqlens_host=lay.cu_host,
                                         backend=name, softmax_scale=lay.scale)
        return run
    return build


def _dense(name: str, rows: str):
    def build(q, k, v, lay):
        be = _backend_or_raise(name, q)
        n = lay.total if rows == "total" else lay.used
        # [T, H, D] -> [1, n, H, D] views; k is the caller's tensor (k_is_scratch=False).
        qb, kb, vb = q[None, :n], k[None, :n], v[None, :n]

        def run():
            return be.dense(qb, kb, vb, softmax_scale=lay.scale, k_is_scratch=False)[0]
        return run
    return build


_PARTS = {"quant": "its quantization alone", "attn": "its attention kernel alone on pre-quantized operands"}
#: variant name -> launch-config overrides (a variant whose fields the kernel's config lacks is skipped)
_SAGE8_VARIANTS = {"v2-running": {"pv_accum": "running"}, "pv-first": {"pv_first": True},
                   "stages2": {"stages": 2}, "3stages-2cta": {"num_stages": 3, "maxnreg": None},
                   "kscale-pipelined": {"kscale_load": "pipelined"},
                   "bn64": {"block_n": 64}, "bn64-s3": {"block_n": 64, "num_stages": 3},
                   # 128 query rows a program: two warpgroups share each K/V tile (half the L2
                   # traffic a query row); 168 registers allow one CTA an SM, 128 two (spilling)
                   "bm128": {"block_m": 128, "num_warps": 8},
                   "bm128-r128": {"block_m": 128, "num_warps": 8, "maxnreg": 128},
                   "bm128-s3": {"block_m": 128, "num_warps": 8, "num_stages": 3, "maxnreg": None}}


def _sage8_variant(backend: str, variant: str):
    def build(q, k, v, lay):
        import dataclasses

        from dist_attn.kernels.sage8 import launch, sage8_dense

        be = _backend_or_raise(backend, q)
        base = launch.default_config(be.impl)
        over = _SAGE8_VARIANTS[variant]
        missing = [f for f in over if f not in {x.name for x in dataclasses.fields(base)}]
        if missing:
            raise Unavailable(f"{type(base).__name__} has no {missing}")
        cfg = dataclasses.replace(base, **over)
        qb, kb, vb = q[None], k[None], v[None]

        def run():
            return sage8_dense(qb, kb, vb, softmax_scale=lay.scale, impl=be.impl, config=cfg)[0]
        return run
    return build


def kernel_specs() -> list[KernelSpec]:
    specs = [
        KernelSpec("sdpa_cudnn", "total", False, _sdpa("CUDNN_ATTENTION"),
                   "torch SDPA, cuDNN backend, all rows"),
        KernelSpec("sdpa_flash", "total", False, _sdpa("FLASH_ATTENTION"),
                   "torch SDPA, flash backend (FlashAttention-2), all rows"),
        KernelSpec("sage_dense", "total", False, _sage_dense,
                   "sageattention.core.sageattn NHD on a clone of K, all rows"),
        KernelSpec("sage_varlen", "used", True, _sage_varlen,
                   "sageattention.core.sageattn_varlen at (0, used, total)"),
        KernelSpec("sage2_direct", "total", False, _sage2_direct,
                   "SageAttention 2 sm90 (per_warp, fp32+fp32), all rows, quantization counted"),
        KernelSpec("fa3_fp8", "total", False, _fa3_fp8(prequant=False),
                   "FA3 FP8, per-head e4m3 quantization in torch counted"),
        KernelSpec("fa3_fp8_prequant", "total", False, _fa3_fp8(prequant=True),
                   "FA3 FP8 on pre-quantized operands (quantization not counted)"),
    ]
    for part in ("quant", "attn"):
        specs.append(KernelSpec(f"sage2_{part}", "total", False, _sage2_part(part),
                                f"SageAttention 2 sm90, {_PARTS[part]}", part=part))
        for n in ("sage8", "sage8_gluon"):
            specs.append(KernelSpec(f"{part}:{n}", "total", False, _sage8_part(n, part),
                                    f"{n}, {_PARTS[part]}", part=part))
    for n in ("sage8", "sage8_gluon"):
        for variant in _SAGE8_VARIANTS:
            specs.append(KernelSpec(f"variant:{n}:{variant}", "total", False, _sage8_variant(n, variant),
                                    f"{n} dense, {variant}"))
    names = [n for n in da_backends.available_backends() if n != "auto"]
    for n in names:
        specs.append(KernelSpec(f"bridge:{n}", "used", True, _bridge(n),
                                f"dist_attn.sage_varlen(backend={n!r}) at (0, used, total), host bounds"))
    for n in names:
        specs.append(KernelSpec(f"dense:{n}", "total", False, _dense(n, "total"),
                                f"get_backend({n!r}).dense on all rows"))
    for n in names:
        specs.append(KernelSpec(f"dense_used:{n}", "used", False, _dense(n, "used"),
                                f"get_backend({n!r}).dense on rows [0, used): the bridge's baseline"))
    return specs


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------
def _inputs(rows: int, heads: int, d: int, dtype, device, *, k_bias: float = 0.0, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, d, generator=g, device=device, dtype=torch.float32).to(dtype)
               for _ in range(3))
    if k_bias:
        k = (k.float() + k_bias).to(dtype)
    return q, k, v


def _layout(total: int, used: int, d: int, device) -> Layout:
    bounds = [0, used, total] if used < total else [0, total]
    return Layout(total=total, used=used, scale=1.0 / math.sqrt(d),
                  cu=torch.tensor(bounds, dtype=torch.int32, device=device), cu_host=bounds)


def _reference_f64(q, k, v, rows: int, scale: float) -> torch.Tensor:
    """Exact attention of rows [0, rows) among themselves, float64, [rows, H, D]."""
    q64, k64, v64 = (t[:rows].double().transpose(0, 1) for t in (q, k, v))  # [H, rows, D]
    p = torch.softmax(q64 @ k64.transpose(1, 2) * scale, dim=-1)
    return (p @ v64).transpose(0, 1)  # [H, rows, D] -> [rows, H, D]


def measure_errors(specs, args, device, dtype, writer: ResultWriter, budget: Budget) -> None:
    specs = [s for s in specs if s.part == "whole"]  # a quantization alone has no output to compare
    total = args.err_seq
    used = max(1, total - (args.seq - args.used)) if args.used < args.seq else total
    lay = _layout(total, used, args.head_dim, device)
    for data, bias in (("N(0,1)", 0.0), ("N(0,1), k+0.5", 0.5)):
        q, k, v = _inputs(total, args.err_heads, args.head_dim, dtype, device, k_bias=bias, seed=1)
        refs = {"total": _reference_f64(q, k, v, total, lay.scale),
                "used": _reference_f64(q, k, v, used, lay.scale)}
        for spec in specs:
            row = {"section": "accuracy", "kernel": spec.name, "data": data, "rows": total,
                   "compared_rows": used if spec.n_kind == "used" else total,
                   "heads": args.err_heads, "head_dim": args.head_dim}
            if budget.expired():
                row.update(status="skipped", reason=_BUDGET_REASON)
                writer.rows.append(row)
                continue
            k_before = k.clone()
            try:
                out = spec.build(q, k, v, lay)()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                n = row["compared_rows"]
                ref = refs[spec.n_kind]
                o = out[:n].double()
                diff = o - ref
                row.update(
                    status="ok",
                    rel_l2=(diff.norm() / ref.norm()).item(),
                    cosine=torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item(),
                    max_abs_err=diff.abs().max().item(),
                    # the caller's K must come back unchanged (sageattention 1.0.6 smooths in place)
                    caller_k_changed=bool((k != k_before).any().item()),
                )
                if spec.padded and used < total:
                    # the bridge promises exact zeros in the padding rows; raw varlen kernels do not
                    row["pad_rows_max_abs"] = out[used:].abs().max().item()
            except Unavailable as exc:
                row.update(status="unavailable", reason=str(exc))
            except Exception as exc:  # noqa: BLE001 - a failing kernel is a row, not a crash
                row.update(status="error", reason=describe_exception(exc))
            finally:
                if row.get("caller_k_changed"):
                    k.copy_(k_before)
            writer.rows.append(row)
        del q, k, v, refs
    writer.save(sections(writer))


def measure_speed(specs, args, device, dtype, writer: ResultWriter, budget: Budget) -> None:
    """Per head count: every kernel built once, then ``--rounds`` rounds of every kernel in turn
    (interleaved, so that clock drift during the run hits all kernels alike); a row's median is the
    median of its rounds' medians. A spent ``--budget-s`` stops before the next round (rows say how
    many rounds they got); quantization-only and attention-only rows get no TFLOP/s."""
    for heads in args.heads:
        w = args.ref_heads / heads if args.ref_heads % heads == 0 else None
        lay = _layout(args.seq, args.used, args.head_dim, device)
        try:
            q, k, v = _inputs(args.seq, heads, args.head_dim, dtype, device, seed=2)
        except Exception as exc:  # noqa: BLE001 (e.g. out of memory)
            for spec in specs:
                writer.rows.append({"section": "speed", "kernel": spec.name, "heads": heads,
                                    "status": "error", "reason": describe_exception(exc)})
            continue
        rows, fns, rounds = [], {}, {}
        for spec in specs:
            n = lay.total if spec.n_kind == "total" else lay.used
            row = {"section": "speed", "kernel": spec.name, "what": spec.what, "heads": heads,
                   "W": int(w) if w else None, "head_dim": args.head_dim, "rows_total": lay.total,
                   "rows_used": lay.used, "N": n, "N_kind": spec.n_kind, "part": spec.part}
            rows.append(row)
            writer.rows.append(row)  # updated in place after every round, saved each time
            if budget.expired():
                row.update(status="skipped", reason=_BUDGET_REASON)
                continue
            try:
                fns[spec.name] = spec.build(q, k, v, lay)
            except Unavailable as exc:
                row.update(status="unavailable", reason=str(exc))
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", reason=describe_exception(exc))
        for _ in range(args.rounds):
            if budget.expired():
                break  # a round cut short would weigh as much as a full one in the median
            for spec, row in zip(specs, rows):
                if spec.name not in fns or row.get("status") == "error":
                    continue
                if budget.expired():
                    break
                try:
                    t = time_fn(fns[spec.name], device=device, iters=args.iters, warmup=args.warmup)
                    rounds.setdefault(spec.name, []).append(t)
                except Exception as exc:  # noqa: BLE001
                    row.update(status="error", reason=describe_exception(exc))
                    continue
                ts = rounds[spec.name]
                med = statistics.median(x.median_ms for x in ts)
                row.update(status="ok", median_ms=med, min_ms=min(x.min_ms for x in ts),
                           max_ms=max(x.max_ms for x in ts), iters=sum(x.iters for x in ts),
                           timing=ts[0].method, rounds=len(ts), round_ms=[x.median_ms for x in ts],
                           tflops=(attention_tflops(row["N"], heads, args.head_dim, med)
                                   if spec.part == "whole" else None))
            writer.save(sections(writer))
        for spec, row in zip(specs, rows):
            if spec.name in fns and "status" not in row:
                row.update(status="skipped", reason=_BUDGET_REASON)
        fns = None
        writer.save(sections(writer))
        del q, k, v
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _derive(writer)


def _derive(writer: ResultWriter) -> None:
    """Adds vs-cuDNN ratios to speed rows and the bridge-overhead rows."""
    speed = [r for r in writer.rows if r.get("section") == "speed" and r.get("status") == "ok"]
    by = {(r["kernel"], r["heads"]): r for r in speed}
    for r in speed:
        ref = by.get(("sdpa_cudnn", r["heads"]))
        if ref and ref.get("tflops") and r.get("tflops") and r.get("part", "whole") == "whole":
            r["vs_cudnn"] = r["tflops"] / ref["tflops"]
    writer.payload["rows"] = [r for r in writer.rows if r.get("section") != "overhead"]
    for r in speed:
        if not r["kernel"].startswith("bridge:"):
            continue
        name = r["kernel"].split(":", 1)[1]
        base = by.get((f"dense_used:{name}", r["heads"]))
        if base is None:
            continue
        pct = (r["median_ms"] / base["median_ms"] - 1.0) * 100.0
        writer.rows.append({"section": "overhead", "status": "ok", "backend": name, "heads": r["heads"],
                            "bridge_ms": r["median_ms"], "dense_used_ms": base["median_ms"],
                            "overhead_pct": pct, "target_pct": 1.0, "meets_target": pct <= 1.0})


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def sections(writer: ResultWriter) -> list[tuple[str, str]]:
    rows = writer.rows
    speed = sorted((r for r in rows if r.get("section") == "speed"), key=lambda r: (-r["heads"],))
    err = [r for r in rows if r.get("section") == "accuracy"]
    over = [r for r in rows if r.get("section") == "overhead"]
    out = [
        ("Speed", "TFLOP/s-equivalent = 4 * N^2 * heads * D / median time. N = `rows_total` (38,016 at "
         "h3-ref) for kernels that attend over all rows (`N_kind` total), N = `rows_used` (37,980) for "
         "the padded (0, used, total) layouts (`N_kind` used). `vs_cudnn` = TFLOP/s / sdpa_cudnn's at "
         "the same heads. W = 56 / heads.\n\n" + markdown_table(speed, [
             ("kernel", "kernel", ""), ("heads", "heads", "d"), ("W", "W", ""), ("N", "N", "d"),
             ("status", "status", ""), ("median_ms", "median ms", ".3f"), ("min_ms", "min ms", ".3f"),
             ("iters", "iters", "d"), ("rounds", "rounds", "d"), ("tflops", "TFLOP/s-eq", ".1f"),
             ("vs_cudnn", "vs cuDNN", ".3f"),
             ("reason", "reason", "")])),
        ("Bridge overhead", "overhead % = (bridge:<b> median / dense_used:<b> median - 1) x 100, the "
         "dense call on exactly rows [0, used) being the baseline. Target: <= 1%.\n\n" + markdown_table(
             over, [("backend", "backend", ""), ("heads", "heads", "d"), ("bridge_ms", "bridge ms", ".3f"),
                    ("dense_used_ms", "dense [0,used) ms", ".3f"), ("overhead_pct", "overhead %", "+.2f"),
                    ("meets_target", "<= 1%", "")])),
        ("Error vs float64", "Reference: attention in float64 of the same bf16 inputs, on the same "
         "device. Padded layouts are compared on rows [0, used); `pad max |o|` is the largest value in "
         "the padding rows (the bridge returns exact zeros there; sageattn_varlen attends the padding "
         "segment to itself). `K changed` = the caller's k was modified by the call.\n\n" + markdown_table(
             err, [("kernel", "kernel", ""), ("data", "data", ""), ("rows", "rows", "d"),
                   ("heads", "heads", "d"), ("status", "status", ""), ("rel_l2", "rel-L2", ".3e"),
                   ("cosine", "cosine", ".6f"), ("max_abs_err", "max abs", ".3e"),
                   ("pad_rows_max_abs", "pad max abs", ".2e"), ("caller_k_changed", "K changed", ""),
                   ("reason", "reason", "")])),
    ]
    return out


def _plot(writer: ResultWriter):
    def draw(plt):
        speed = [r for r in writer.rows if r.get("section") == "speed" and r.get("tflops")]
        err = [r for r in writer.rows if r.get("section") == "accuracy" and r.get("rel_l2") is not None]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [2, 1]})
        kernels = list(dict.fromkeys(r["kernel"] for r in speed))
        heads = sorted({r["heads"] for r in speed}, reverse=True)
        ref = writer.payload["config"]["ref_heads"]
        width = 0.8 / max(1, len(heads))
        for i, h in enumerate(heads):
            vals = [next((r["tflops"] for r in speed if r["kernel"] == k and r["heads"] == h), 0.0)
                    for k in kernels]
            ax1.bar([x + i * width for x in range(len(kernels))], vals, width,
                    label=f"{h} heads" + (f" (W={ref // h})" if ref % h == 0 else ""))
        ax1.set_xticks([x + width * (len(heads) - 1) / 2 for x in range(len(kernels))])
        ax1.set_xticklabels(kernels, rotation=40, ha="right", fontsize=8)
        ax1.set_ylabel("TFLOP/s-equivalent (4 N^2 H D / t)")
        ax1.set_title(f"attention forward, {writer.gpu}, {writer.payload['config']['seq']} rows, bf16")
        if ax1.get_legend_handles_labels()[0]:
            ax1.legend(fontsize=8)
        ekern = list(dict.fromkeys(r["kernel"] for r in err))
        for j, data in enumerate(sorted({r["data"] for r in err})):
            vals = [next((r["rel_l2"] for r in err if r["kernel"] == k and r["data"] == data), 0.0)
                    for k in ekern]
            ax2.bar([x + j * 0.4 for x in range(len(ekern))], vals, 0.4, label=data)
        ax2.set_yscale("log")
        ax2.set_xticks([x + 0.2 for x in range(len(ekern))])
        ax2.set_xticklabels(ekern, rotation=40, ha="right", fontsize=8)
        ax2.set_ylabel("rel-L2 error vs float64")
        if ax2.get_legend_handles_labels()[0]:
            ax2.legend(fontsize=8)
        fig.tight_layout()
    return draw


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=_int_list, default=None,
                   help="per-rank head counts, run in this order (default 14,56,7,28 = W 4,1,8,2)")
    p.add_argument("--seq", type=int, default=None, help="packed rows (total; default 38016)")
    p.add_argument("--used", type=int, default=None, help="used rows of (0, used, total) (default 37980)")
    p.add_argument("--head-dim", type=int, default=None, help="D (default 128)")
    p.add_argument("--ref-heads", type=int, default=None,
                   help="heads at W=1, for the W column (default 56; the largest --heads with --smoke)")
    p.add_argument("--kernels", default="*", help="comma-separated fnmatch patterns of kernel names")
    p.add_argument("--err-seq", type=int, default=None, help="rows of the error shape (default 4096)")
    p.add_argument("--err-heads", type=int, default=None, help="heads of the error shape (default 4)")
    p.add_argument("--no-error", action="store_true", help="skip the error section")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleaved rounds of every kernel per head count; the median of the rounds' "
                        "medians is reported (default 1)")
    add_common_args(p, iters=20, warmup=3, budget_s=0)
    args = p.parse_args(argv)

    smoke = args.smoke
    defaults = ({"heads": [4, 2], "seq": 256, "used": 240, "head_dim": 64, "err_seq": 96, "err_heads": 2}
                if smoke else {"heads": [14, 56, 7, 28], "seq": H3_REF["total"], "used": H3_REF["used"],
                               "head_dim": H3_REF["head_dim"], "err_seq": 4096, "err_heads": 4})
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    if args.ref_heads is None:
        args.ref_heads = max(args.heads) if smoke else H3_REF["heads"]
    if smoke and args.iters == 20:
        args.iters, args.warmup = 3, 1
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds} must be at least 1")
    if not 0 < args.used <= args.seq:
        p.error(f"--used={args.used} must lie in (0, --seq={args.seq}]")
    device = torch.device("cuda" if (args.device == "cuda" or (args.device == "auto" and not smoke
                                                                and torch.cuda.is_available()))
                          else "cpu")
    if smoke and args.device == "cuda":
        device = torch.device("cuda")
    dtype = torch.bfloat16
    budget = Budget(args.budget_s)

    patterns = [s.strip() for s in args.kernels.split(",") if s.strip()]
    specs = [s for s in kernel_specs() if any(fnmatch.fnmatchcase(s.name, pat) for pat in patterns)]
    unmatched = [pat for pat in patterns
                 if not any(fnmatch.fnmatchcase(s.name, pat) for s in kernel_specs())]
    if unmatched or not specs:
        p.error(f"--kernels {args.kernels!r}: {', '.join(map(repr, unmatched or patterns))} "
                "matches no kernel; the names are listed in --help")
    try:
        auto = da_backends.resolve_backend("auto", torch.empty(1, args.head_dim, device=device,
                                                               dtype=dtype)).name
    except Exception as exc:  # noqa: BLE001
        auto = f"none ({describe_exception(exc)})"
    config = {
        "workload": "h3-ref per rank" if not smoke else "smoke (tiny)", "seq": args.seq, "used": args.used,
        "cu_seqlens": [0, args.used, args.seq], "heads": args.heads, "ref_heads": args.ref_heads,
        "head_dim": args.head_dim, "dtype": str(dtype), "causal": False, "iters": args.iters,
        "warmup": args.warmup, "rounds": args.rounds, "err_seq": args.err_seq, "err_heads": args.err_heads,
        "kernels": [s.name for s in specs], "kernel_patterns": patterns, "device": str(device),
        "registered_backends": list(da_backends.available_backends()), "auto_resolves_to": auto,
        "budget_s": args.budget_s, "smoke": smoke,
    }
    writer = ResultWriter(theme=THEME, args=args, config=config, device=device,
                          title="Attention kernels at h3-ref per-rank shapes")
    writer.note("TFLOP/s-equivalent = 4 * N^2 * heads * D / time; N = 38,016 (all rows) for dense "
                "calls, N = 37,980 (used rows) for the padded (0, used, total) layouts.")
    writer.note("sage_dense / sage_varlen run on a scratch clone of K: sageattention 1.0.6 subtracts "
                "the key mean in place. Their times include that smoothing and the V cast to fp16.")
    if device.type != "cuda":
        writer.note("CPU run: only the torch SDPA backend (math) runs; CUDA kernels are listed as "
                    "unavailable with their reason. Numbers are not representative of anything.")
    print(f"[kernels] device={device} ({writer.gpu}); kernels: {', '.join(config['kernels'])}", flush=True)
    if not args.no_error:
        measure_errors(specs, args, device, dtype, writer, budget)
    measure_speed(specs, args, device, dtype, writer, budget)
    writer.payload["elapsed_s"] = budget.elapsed()
    paths = writer.finish(_plot(writer), sections(writer))
    for r in writer.rows:
        if r.get("section") == "speed":
            print(f"  {r['kernel']:<22} heads={r['heads']:<3} {r.get('status'):<11} "
                  f"{(r.get('median_ms') or 0):9.3f} ms  {(r.get('tflops') or 0):7.1f} TFLOP/s  "
                  f"{r.get('reason', '')[:90]}", flush=True)
        elif r.get("section") == "overhead":
            print(f"  bridge overhead {r['backend']:<8} heads={r['heads']:<3} {r['overhead_pct']:+.2f}%")
    print(f"[kernels] wrote {paths['json']} (+ .md, .png) in {budget.elapsed():.1f}s", flush=True)
    return paths


if __name__ == "__main__":
    main()
