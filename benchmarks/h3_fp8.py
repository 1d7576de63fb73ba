# SPDX-License-Identifier: Apache-2.0
"""FP8 linear layers on the real H3, one GPU, one run: its GEMMs, its block at W = 1 and at W = 4's
per-rank shapes (eager, compiled), and what FP8 does to the served latents.

The block is ``MiniMaxH3Transformer3DModel()``'s (default config, own init, bf16: ``build_h3`` with
1 layer, no refiner); its FP8 twin is the same weights through ``quantize_linears(model, "fp8")``
(torchao; the float32 emulation only with ``--smoke`` on CPU). Sections, in budget order:

* ``gemm``: q/k/v (5376->7168, 3 per block), out (7168->5376), FFN in (5376->28672), FFN out
  (14336->5376) at 38,016 and 9,504 rows: ``bf16``; ``fp8`` = the quantized linear (activation
  quantization + ``torch._scaled_mm``, fp32 accumulation); ``fp8_fast`` (fast accumulation);
  ``scaled_mm[_fast]`` = the GEMM alone on pre-quantized operands; ``scaled_mm_tensor[_fast]`` =
  the same with one scale per tensor (x and w), the other cuBLAS route; ``quant[_tensor]`` = the
  activation quantization alone, per row (one pass) or per tensor (two). TFLOP/s, x bf16, rel-L2 vs float64 (1,024 rows of N(0,1) with two x20
  outlier channels; the layer's own init).
* ``block`` (W = 1, 37,980 rows): ``bf16`` | ``fp8`` | ``fp8fast`` (fast accumulation) |
  ``fp8fastunfused`` (the same with diffusers' SwiGLU and torchao's down projection,
  ``quantize_linears(fuse_swiglu=False)``; the FP8 rows fuse the FFN's SwiGLU and its
  quantization on CUDA since 2026-12-06, ``fuse_swiglu="auto"``) | ``fp8fastadaln`` (``fp8fast``
  with each norm + AdaLN modulation and its quantization in one kernel: the library's default
  on CUDA since 2026-12-07, ``fuse_adaln="auto"``, asked for here as ``True``; the other FP8 rows
  pass ``fuse_adaln=False``, diffusers' block forward) | ``fp8adaln`` (the same with float32
  accumulation: the library's defaults on CUDA) | ``fp8tfast`` (per-tensor scales, fast accumulation: benchmark-only, GPU-only, compiled rows
  named in ``--compiled`` and one accuracy row) linears x attention ``sdpa`` | ``sage8`` |
  ``fa3`` (dist_attn's H3 processor, one rank) | ``native`` (diffusers') | ``none`` (an opaque op
  that reads q, k, v: the block's rest; an ``empty_like`` stand-in would let the compiler drop
  the q/k/v projections, as in h3-model's 30.8 ms compiled "none") | ``sage8_cute`` (the CuTe
  loop: ``--compiled`` rows only, with ``DIST_ATTN_SAGE8_CUTE=1``); ``none@w4``: the rest at
  9,504 rows. Eager all, once each; compiled (``torch.compile(block, fullgraph=True, dynamic=False)``)
  the ``--compiled`` list, in its order, after the accuracy section, each path on its own copy of
  the block and timed once after its compilation (``first_ms``), then ``--rounds`` passes over all
  of them: median of the rounds' medians. A ``+mk`` suffix (``fp8fast:sage8+mk``,
  ``fp8fast:none+mk@w4``) compiles the same path with inductor's ``triton.multi_kernel=1``.
* ``w4`` (modeled as ``benchmarks.scaling --modeled`` does): rank 0 of Ulysses 4 = ``none@w4`` +
  its attention layer: pack + all-to-alls (bytes / ``--bandwidth-gbs``: q, k, v in, the output
  back) + attention at 14 heads x 38,016 rows + unpack, plain (C = 1) or with the heads in
  ``--overlap`` C chunks pipelined against their all-to-alls (``overlap_chunks``), cut as the core
  cuts them: ``chunking`` "even", and "waves" where the backend reports its kernel's waves and
  the wave-aligned widths differ (``dist_attn.plan.chunk_widths``); ``step_s`` =
  50 such blocks (refiner, embeddings and heads left out). Its parts are timed in ``--rounds``
  interleaved passes (from the run of 2026-12-05 12:22; before, once each, in turn). Runs before 2026-12-05
  counted the all-to-alls twice (+1.135 ms a block); ``benchmarks.job_model`` corrects their rows.
* ``w4-seq`` (with the compiled rows): the same rank-0 block computed in one piece, C = 1: the
  compiled rest, pack, attention at 14 heads and unpack back to back in ``--rounds`` passes, plus
  the all-to-alls from bytes: the GPU in the state the block's own mix puts it in.
* ``accuracy``: the served engine (configs/h3.toml, ``--acc-layers`` 8 x ``--acc-steps`` 3, its
  default request of 38,222 rows, W = 1): final latents of bf16:sage8, fp8:sdpa, fp8:sage8,
  fp8fast:sage8 (and the other recipes) vs bf16:sdpa, eager; at the end of the run (after the
  compiled block rows, whose timing then sees no compiled engine before it) the ``--acc-compiled``
  paths with the blocks compiled as the server compiles them, also against their own eager run.

    python -m benchmarks.h3_fp8                       # one H200, ~4.5 min (--budget-s 270)
    python -m benchmarks.h3_fp8 --smoke --modes eager   # CPU, the tiny config, seconds
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.h3_block import attach, block_inputs, h3_ref_layout, padded_total
from benchmarks.h3_fp8_report import plot, report, targets
from benchmarks.harness import (Budget, ResultWriter, add_common_args, describe_exception, device_timeline_ms,
                                kernel_table, smoke_values, time_fn)
from benchmarks.scaling import overlapped_ms

__all__ = ["main"]

THEME, _REPO = "h3-fp8", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIPPED = "skipped: the --budget-s wall-time budget was spent"
_ATTN = ("sdpa", "sage8", "fa3", "native", "none")
#: attention only in ``--compiled`` rows (an optional extra: never in the eager pass)
_ATTN_OPT_IN = ("sage8_cute",)
#: ``--compiled`` suffixes: the same path compiled with other inductor options (benchmark-only)
_VARIANTS: dict[str, dict | None] = {"": None, "mk": {"triton.multi_kernel": 1}}
_PRECISIONS = ("bf16", "fp8", "fp8adaln", "fp8fast", "fp8fastadaln", "fp8fastunfused", "fp8tfast")
_COMPILED = ("fp8:sage8,fp8fast:sage8,bf16:sage8,fp8:none@w4,fp8fast:none@w4,bf16:none@w4,bf16:native,"
             "fp8:sdpa,bf16:sdpa,fp8:native")


@torch.library.custom_op("h3fp8bench::no_attention", mutates_args=())
def _no_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


_no_attention.register_fake(lambda q, k, v: torch.empty_like(q))


class _NoAttention(torch.nn.Module):
    """Attention replaced by nothing, opaquely: q, k, v must still be computed."""

    def forward(self, q, k, v, **kwargs):
        return _no_attention(q, k, v)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _timed(fn, dev, args, budget) -> dict:
    t = time_fn(fn, device=dev, iters=args.iters, warmup=args.warmup, budget=budget)
    return {"median_ms": t.median_ms, "min_ms": t.min_ms, "iters": t.iters, "timing": t.method}


def _time_rounds(entries, args, dev, budget, reserve_s: float) -> None:
    """Times every ``(record, fn)`` in ``--rounds`` passes, each pass over all of them in turn, so
    the GPU's drift over the run (clocks, temperature) falls on all alike. Each record gets
    ``rounds_ms`` (the rounds' medians), ``median_ms`` (their median), ``min_ms`` and ``rounds``
    (text). A call that raises makes its record an error and later rounds skip it; once the
    budget is spent a record keeps the rounds it has (at least one)."""
    mins = {id(rec): [] for rec, _ in entries}
    for rec, _ in entries:
        rec["rounds_ms"] = []
    with torch.no_grad():
        for _ in range(max(1, args.rounds)):
            for rec, fn in entries:
                if rec.get("status") == "error" or (rec["rounds_ms"] and budget.expired(reserve_s=reserve_s)):
                    continue
                try:
                    t = _timed(fn, dev, args, budget)
                except Exception as exc:  # noqa: BLE001 - one failed path is a row, not a lost run
                    rec.update(status="error", reason=describe_exception(exc))
                    continue
                rec["rounds_ms"].append(t["median_ms"])
                mins[id(rec)].append(t["min_ms"])
    for rec, _ in entries:
        if rec["rounds_ms"]:
            rec.update(median_ms=statistics.median(rec["rounds_ms"]), min_ms=min(mins[id(rec)]),
                       rounds=" / ".join(f"{t:.2f}" for t in rec["rounds_ms"]))


def _unavailable(backend: str, dev, cfg) -> str | None:
    """Why the dist_attn ``backend`` cannot run here (None: it can)."""
    if backend in ("native", "none"):
        return None
    from dist_attn import resolve_backend

    probe = torch.empty(1, cfg.model.num_heads, cfg.model.head_dim, dtype=torch.bfloat16, device=dev)
    try:
        resolve_backend(backend, probe)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run is a row with its reason
        return describe_exception(exc)
    return None


def _kernel_waves(backend: str, layout, q: torch.Tensor, dev, cfg):
    """The backend's ``kernel_waves`` for a call over ``layout`` (None: unknown or unavailable),
    as the core asks it before cutting overlapped chunks."""
    if _unavailable(backend, dev, cfg) is not None:
        return None
    from dist_attn import backends as da_backends

    return da_backends.get_backend(backend).kernel_waves(layout, q)


def _models(cfg, dev, emulate: bool):
    """(summary, models): ``"bf16"``, ``"fp8"`` (the eager rows' models: 1 block, no refiner, the same
    weights); ``"copy"``: a function of a precision (``_PRECISIONS``: see :func:`_quantize`) that
    makes one more such model (each compiled path gets its own)."""
    from dist_attn.models.h3.fp8 import quantize_linears
    from dist_attn.models.h3.serve.h3.model import build_h3

    one = dataclasses.replace(cfg.model, num_layers=1, num_refiner_layers=0)
    bf16 = build_h3(one, device=dev, dtype=torch.bfloat16)
    pristine = copy.deepcopy(bf16)

    def make(prec: str):
        model = copy.deepcopy(pristine)
        if prec != "bf16":
            _quantize(model, prec, emulate)
        return model

    fp8 = copy.deepcopy(pristine)
    summary = quantize_linears(fp8, "fp8", emulate=emulate, fuse_adaln=False)  # as _quantize("fp8")
    return summary, {"bf16": bf16, "fp8": fp8, "copy": make}


def _recipe_unavailable(prec: str, emulate: bool) -> str | None:
    if prec == "fp8tfast" and emulate:
        return "fp8tfast (per-tensor scales) is a GPU-only benchmark recipe: no float32 emulation"
    return None


def _quantize(model, prec: str, emulate: bool) -> None:
    """The block linears of ``model`` in ``prec``: ``fp8`` / ``fp8fast``, the shipped recipe
    (``quantize_linears``, fused SwiGLU FFNs on CUDA), with float32 / fast accumulation;
    ``fp8fastunfused``, the same as ``fp8fast`` with diffusers' FFN (``fuse_swiglu=False``);
    ``fp8fastadaln`` / ``fp8adaln``, ``fp8fast`` / ``fp8`` with the fused AdaLN inputs
    (``fuse_adaln=True``; the other recipes ``False``): ``fp8adaln`` is the library's default on CUDA;
    ``fp8tfast``, a benchmark-only recipe: torchao with ONE scale per
    activation tensor and per weight, fast accumulation (the other cuBLAS FP8 route)."""
    from dist_attn.models.h3.fp8 import quantize_linears

    if prec != "fp8tfast":
        quantize_linears(model, "fp8", emulate=emulate, fast_accum=prec.startswith("fp8fast"),
                         fuse_swiglu=False if prec == "fp8fastunfused" else "auto",
                         fuse_adaln=prec.endswith("adaln"))  # True: fails loudly, runs emulated too
        return
    from torchao.quantization import PerTensor, quantize_

    from dist_attn.models.h3.fp8.linear import torchao_fp8_config
    from dist_attn.models.h3.fp8.quantize import fp8_linear_names

    wanted = set(fp8_linear_names(model))
    # the shipped recipe's config (floor, kernel preference, inductor settings), one scale per tensor
    config = dataclasses.replace(torchao_fp8_config(fast_accum=True), granularity=PerTensor())
    quantize_(model, config, filter_fn=lambda module, fqn: fqn in wanted)
    for name in wanted:
        if not hasattr(model.get_submodule(name).weight, "qdata"):
            raise RuntimeError(f"torchao left {name} unquantized")


def run_gemm(args, cfg, dev, emulate, budget, rows) -> None:
    from dist_attn.models.h3.fp8.linear import (ACTIVATION_AMAX_FLOOR, quantize_rows_e4m3,
                                                quantize_weight_e4m3)

    m = cfg.model
    shapes = {"qkv": (m.hidden_size, m.inner_dim), "out": (m.inner_dim, m.hidden_size),
              "ff_in": (m.hidden_size, 2 * m.ffn_dim), "ff_out": (m.ffn_dim, m.hidden_size)}
    for n_rows in args.gemm_rows:
        for name, (k, n) in shapes.items():
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(n_rows, k, device=dev, generator=g)
            x[:, [3, k // 2]] *= 20  # outlier channels
            x = x.to(torch.bfloat16)
            lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            w = lin.weight.detach()
            wc, ws = quantize_weight_e4m3(w)
            xc, xs = quantize_rows_e4m3(x, amax_floor=ACTIVATION_AMAX_FLOOR)
            ref = x[:1024].double() @ w.double().t()  # errors are per row: 1,024 rows suffice
            variants = {"bf16": lambda: F.linear(x, w)}
            for fast, tag in ((False, ""), (True, "_fast")):
                variants["fp8" + tag] = _fp8_linear(lin, x, emulate, fast)
                variants["scaled_mm" + tag] = (lambda f: lambda: torch._scaled_mm(
                    xc, wc.t(), xs, ws.t(), out_dtype=torch.bfloat16, use_fast_accum=f))(fast)
            # per-tensor scales (one for x, one for w): the other cuBLAS FP8 route, timed beside
            # the per-row one to know what the recipe's accuracy costs in GEMM time
            xt, xts = _quantize_tensor_e4m3(x)
            wt, wts = _quantize_tensor_e4m3(w)
            for fast, tag in ((False, ""), (True, "_fast")):
                variants["scaled_mm_tensor" + tag] = (lambda f: lambda: torch._scaled_mm(
                    xt, wt.t(), xts, wts, out_dtype=torch.bfloat16, use_fast_accum=f))(fast)
            variants["quant"] = lambda: quantize_rows_e4m3(x, amax_floor=ACTIVATION_AMAX_FLOOR)
            variants["quant_tensor"] = lambda: _quantize_tensor_e4m3(x)
            base = None
            for variant, fn in variants.items():
                row = {"section": "gemm", "shape": name, "rows": n_rows, "k": k, "n": n, "path": variant,
                       "mode": "eager", "kernel": "emulated" if emulate and "fp8" in variant else None}
                if budget.expired(reserve_s=args.reserve_s):
                    row.update(status="skipped", reason=_SKIPPED)
                    rows.append(row)
                    continue
                try:
                    with torch.no_grad():
                        row.update(status="ok", **_timed(fn, dev, args, budget))
                        if not variant.startswith("quant"):
                            row["tflops"] = 2 * n_rows * k * n / row["median_ms"] / 1e9
                            row["rel_l2"] = _rel(fn()[:1024], ref)
                    base = row["median_ms"] if variant == "bf16" else base
                    if base and not variant.startswith("quant"):
                        row["x_bf16"] = base / row["median_ms"]
                except Exception as exc:  # noqa: BLE001
                    row.update(status="unavailable", reason=describe_exception(exc))
                rows.append(row)
            del x, lin, w, wc, xc, xt, wt, ref, variants


def _quantize_tensor_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of ``x`` with ONE float32 scale (0-dim): max |x| / 448, floored like activations."""
    from dist_attn.models.h3.fp8.linear import ACTIVATION_AMAX_FLOOR, E4M3_MAX

    scale = (x.abs().amax().float().clamp(min=ACTIVATION_AMAX_FLOOR) / E4M3_MAX)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _fp8_linear(lin, x, emulate: bool, fast: bool):
    """A call of ``lin``'s FP8 twin on ``x``: torchao's (``fast``: fast accumulation) or emulated."""
    from dist_attn.models.h3.fp8.linear import EmulatedFp8Linear, torchao_fp8_config

    if emulate:
        twin = EmulatedFp8Linear.from_linear(lin)
    else:
        from torchao.quantization import quantize_

        seq = torch.nn.Sequential(copy.deepcopy(lin))
        quantize_(seq, torchao_fp8_config(fast_accum=fast))
        twin = seq[0]
    return lambda: twin(x)


def _set_attention(block, attn: str, heads: int, head_dim: int, valid_len: int) -> None:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    from dist_attn import UlyssesSageAttention

    if attn == "native":
        block.attn.set_processor(MiniMaxH3AttnProcessor())
    elif attn == "none":
        # the rest of the block as a rank of the 8-bit model runs it: q/k norm + RoPE belong to the
        # pack (measure_w4_parts times it so); the model's sdpa / fa3 rows reuse both, where their
        # served route would run diffusers' ops in the rest (~0.36 ms a block more at 9,504 rows)
        attach(block, _NoAttention(), valid_len, fused=True)
    else:
        attach(block, UlyssesSageAttention(heads, head_dim, backend=attn), valid_len)


def run_blocks(args, cfg, dev, models, budget, rows, mode: str, rest: dict, on_live=None) -> None:
    """Block rows of ``mode`` (W = 1 at h3-ref; ``none@w4``: the block's rest at 9,504 rows, whose
    times go to ``rest[(precision, mode)]`` for the w4 model).

    Eager: one pass, each path timed once. Compiled: every path gets its own block (the same
    weights), is compiled and timed once (``first_ms``: right after its compilation, the GPU idle
    while it compiled), and stays compiled; then ``--rounds`` passes time every path in turn
    (:func:`_time_rounds`): a row's ``median_ms`` is the median of its rounds' medians. ``on_live``
    (compiled) is called with the (row, callable, inputs) of every compiled path before they go."""
    m, lay, total = cfg.model, args.layout, padded_total(args.layout.used)
    inputs = {"w1": block_inputs(m, lay, lay.used, lay.used, 0, dev, torch.bfloat16),
              "w4": block_inputs(m, lay, total, total // 4, 0, dev, torch.bfloat16)}
    keys = ([f"{p}:{a}" for p in ("fp8", "bf16") for a in _ATTN + ("none@w4",)] if mode == "eager"
            else _names(args.compiled))
    live = []  # compiled: (row, callable, its inputs)
    # compiled: one cache entry per path on the block's forward; never fall back to eager silently
    limits = {"recompile_limit": max(64, 2 * len(keys)), "fail_on_recompile_limit_hit": True}
    with torch._dynamo.config.patch(limits):
        for key in keys:
            prec, attn, variant, at_w4 = _split_key(key)
            where = "w4" if at_w4 else "w1"
            row = {"section": "block" if where == "w1" else "w4-rest", "path": key, "mode": mode,
                   "rows": inputs[where][0].shape[1]}
            reason = _unavailable(attn, dev, cfg) or _recipe_unavailable(prec, args.emulate)
            if reason:
                row.update(status="unavailable", reason=reason)
            elif budget.expired(reserve_s=args.compile_reserve_s if mode == "compiled" else args.reserve_s):
                row.update(status="skipped", reason=_SKIPPED)
            else:
                try:
                    block = (models[prec] if mode == "eager" else models["copy"](prec)).transformer_blocks[0]
                    res, fn = _block_row(block, attn, mode, inputs[where], lay.used, m, dev, args, budget,
                                         profile=key in _names(args.profile), options=_VARIANTS[variant])
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory for one more copy
                    res, fn = {"status": "error", "reason": describe_exception(exc)}, None
                row.update(res)
                if fn is not None:
                    row["first_ms"] = row.pop("median_ms")  # right after its compilation: not a round
                    live.append((row, fn, inputs[where]))
            rows.append(row)
            args.writer.save()
            print(row, flush=True)
        if live:
            _time_rounds([(row, lambda fn=fn, inp=inp: fn(*inp)) for row, fn, inp in live], args, dev, budget,
                         args.compile_reserve_s)
            for row, _fn, _inp in live:
                print(row["path"], "rounds", row.get("rounds"), row.get("reason", ""), flush=True)
            if on_live is not None:
                on_live(live)
    if mode == "compiled":
        del live
        torch._dynamo.reset()
    for row in rows:
        if (row.get("section") == "w4-rest" and row["mode"] == mode and row.get("status") == "ok"
                and "+" not in row["path"]):
            rest[(row["path"].split(":")[0], mode)] = row["median_ms"]
    args.writer.save()


def _block_row(block, attn, mode, inputs, valid_len, m, dev, args, budget, profile=False, options=None):
    """(row fields, the compiled callable to time again or None). Eager rows share one block per
    precision, so their dynamo state is reset after each; compiled rows own their block."""
    t0 = time.perf_counter()
    try:
        _set_attention(block, attn, m.num_heads, m.head_dim, valid_len)
        fn = (torch.compile(block, fullgraph=True, dynamic=False, options=options)
              if mode == "compiled" else block)
        with torch.no_grad():
            out = _timed(lambda: fn(*inputs), dev, args, budget)
            if profile:
                out["kernels"] = kernel_table(lambda: fn(*inputs), dev)
        return {"status": "ok", **out, "wall_s": time.perf_counter() - t0}, (fn if mode == "compiled" else None)
    except Exception as exc:  # noqa: BLE001
        return {"status": "error", "reason": describe_exception(exc)}, None
    finally:
        if mode == "eager":
            torch._dynamo.reset()


def measure_w4_parts(args, cfg, dev, budget) -> dict:
    """Rank 0 of Ulysses 4 at h3-ref, for each ``--overlap`` C: the core's pack calls (one by one),
    its C chunks' unpack and the
    attention at each chunk's heads over all rows (the receive buffer's strided q/k/v views, as in
    the core), measured; the all-to-alls computed from the bytes rank 0 sends to the 3 others."""
    from dist_attn import backends as da_backends
    from dist_attn import QKNormRope
    from dist_attn.comm import pack_qkv_chunks, unpack_output, unpack_qkv
    from dist_attn.kernels.qk_norm_rope import pack_qkv_prologue, qk_norm_rope
    from dist_attn.plan import make_plan
    from dist_attn.varlen import attend_varlen, segment_layout

    m, lay, total = cfg.model, args.layout, padded_total(args.layout.used)
    s_local, H, D = total // 4, m.num_heads, m.head_dim
    q, k, v = (torch.randn(1, s_local, H, D, device=dev).to(torch.bfloat16) for _ in range(3))
    rot = 6 * m.rope_freq_dim
    prologue = QKNormRope(torch.ones(D, device=dev, dtype=torch.bfloat16), torch.ones(D, device=dev, dtype=torch.bfloat16),
                          m.qk_norm_eps, torch.rand(s_local, rot, device=dev), torch.rand(s_local, rot, device=dev))
    send = torch.empty(s_local * 3 * H * D, device=dev, dtype=torch.bfloat16)
    recv_out = torch.randn(s_local * H * D, device=dev).to(torch.bfloat16)
    out = torch.empty_like(q)
    h0 = make_plan(world=4, rank=0, s_local=s_local, folded_heads=H, head_dim=D, overlap_chunks=1).counts[0]
    one_tensor_ms = s_local * (H - h0) * D * 2 / (args.bandwidth_gbs * 1e9) * 1e3
    parts = {"s_local": s_local, "heads": h0, "a_in_ms": 3 * one_tensor_ms, "a_out_ms": one_tensor_ms,
             "chunks": {}, "rounds": {}}
    cu = torch.tensor([0, lay.used, total], dtype=torch.int32, device=dev)
    layout = segment_layout([0, lay.used, total], total=total, valid_len=lay.used)
    views: dict[int, tuple] = {}  # width -> the receive buffer's q/k/v views and an output
    timers: dict[tuple, object] = {}  # ("kernel", backend, width) | ("pack" | "unpack", widths, call) -> callable
    failed: dict[tuple, str] = {}

    def kernel(backend: str, width: int):
        key = ("kernel", backend, width)
        if key in timers or key in failed:
            return
        reason = _unavailable(backend, dev, cfg)
        if reason is None:
            try:
                be = da_backends.get_backend(backend)
                if width not in views:
                    recv = torch.randn(total * 3 * width * D, device=dev).to(torch.bfloat16)
                    views[width] = (*unpack_qkv(recv, total, width, D),  # [S, 3, w, D] -> 3 x [S, w, D]
                                    torch.empty(total, width, D, device=dev, dtype=torch.bfloat16))
                qv, kv, vv, o = views[width]

                def call():
                    attend_varlen(be, qv[None], kv[None], vv[None], layout=layout, cu_seqlens=cu,
                                  softmax_scale=D ** -0.5, k_is_scratch=True, out=o[None])
                with torch.no_grad():
                    call()  # compiles / fails here, not inside a timing round
                timers[key] = call
            except Exception as exc:  # noqa: BLE001
                reason = describe_exception(exc)
        if reason:
            failed[key] = reason

    # per backend and C, the core's plan: the even split, and the wave-aligned one where the
    # backend reports its kernel's waves (dist_attn.plan.chunk_widths) and it differs
    plans: dict[tuple, tuple[int, ...]] = {}  # (backend, C, chunking) -> rank 0's chunk widths
    runs: dict[tuple, list[int]] = {}  # chunk widths -> how many chunks each of the core's pack calls packs
    for C in args.overlap:
        for backend in ("sdpa", "sage8", "fa3"):
            waves = _kernel_waves(backend, layout, q, dev, cfg)
            for chunking, wv in (("even", None), ("waves", waves)):
                if chunking == "waves" and wv is None:
                    continue
                plan = make_plan(world=4, rank=0, s_local=s_local, folded_heads=H, head_dim=D,
                                 overlap_chunks=C, waves=wv)
                widths = tuple(c.local_heads(0) for c in plan.chunks)
                if chunking == "waves" and widths == plans[backend, C, "even"]:
                    continue
                plans[backend, C, chunking] = widths
                if ("unpack", widths, 0) not in timers:
                    runs[widths] = [b - a for a, b in plan.pack_runs]
                    for i, (a, b) in enumerate(plan.pack_runs):  # the core's pack calls, one by one
                        run = plan.chunks[a:b]

                        def pack(span=(run[0].in_send[0], run[-1].in_send[1]),
                                 ranges=[c.head_ranges for c in run]):
                            # q/k norm + RoPE in the pack, as the 8-bit route's rank runs it
                            if not pack_qkv_prologue(q, k, v, send[span[0]:span[1]], ranges, prologue):
                                # the core's other route (e.g. a CPU): the one-pass kernel, then
                                # the plain pack; timed as such, never a pack without the prologue
                                p = prologue
                                qq, kk = qk_norm_rope(q, k, p.q_weight, p.k_weight, p.eps, p.cos, p.sin)
                                pack_qkv_chunks(qq, kk, v, send[span[0]:span[1]], ranges)
                        timers["pack", widths, i] = pack
                    for i, c in enumerate(plan.chunks):  # the core's unpack calls, one by one

                        def unpack(span=c.out_recv, ranges=c.head_ranges):
                            unpack_output(recv_out[span[0]:span[1]], out, ranges)
                        timers["unpack", widths, i] = unpack
                for w in set(widths):
                    kernel(backend, w)
    # every part timed once per round, in the same order: the medians of the rounds' medians
    recs = {key: {} for key in timers}
    _time_rounds([(recs[key], fn) for key, fn in timers.items()], args, dev, budget, args.reserve_s)
    med = {}
    for key, rec in recs.items():
        if rec.get("status") == "error":
            if key[0] != "kernel":
                raise RuntimeError(f"{key[0]} of the w4 model failed: {rec['reason']}")
            failed[key] = rec["reason"]
        else:
            med[key] = rec["median_ms"]
    def name(key):  # ("pack", (2, 4, 4, 4), 1) -> "pack 2,4,4,4 1"
        return " ".join(",".join(map(str, x)) if isinstance(x, tuple) else str(x) for x in key)
    parts["rounds"] = {name(key): rec["rounds_ms"] for key, rec in recs.items()}
    for (backend, C, chunking), widths in plans.items():
        bad = next((failed[key] for w in widths if (key := ("kernel", backend, w)) in failed), None)
        pack_runs = [[n, med["pack", widths, i]] for i, n in enumerate(runs[widths])]
        unpacks = [med["unpack", widths, i] for i in range(len(widths))]
        parts["chunks"][backend, C, chunking] = {
            "widths": list(widths), "pack_ms": sum(ms for _, ms in pack_runs), "pack_runs": pack_runs,
            "unpack_ms": sum(unpacks), "unpack_chunk_ms": unpacks,
            "kernel_ms": bad if bad else [med["kernel", backend, w] for w in widths]}
    parts["timers"] = timers  # kept for run_w4_sequence (their closures hold the buffers); not saved
    return parts


def run_w4_sequence(args, parts: dict, live, dev, budget, rows) -> None:
    """``w4-seq`` rows: rank 0's W = 4 block computed in one piece on one GPU, C = 1: the compiled
    rest at 9,504 rows, the pack, the attention at 14 heads over 38,016 rows and the unpack, back
    to back as a served step runs them, timed in ``--rounds`` interleaved passes; the all-to-alls
    added from bytes as in ``w4``. Beside ``w4``'s sum of parts each timed alone, this one sees
    the GPU in the state the block's own mix of work puts it in."""
    timers, seqs = parts.get("timers", {}), []
    for row, fn, inp in live:
        if row["section"] != "w4-rest" or row.get("status") != "ok":
            continue
        for backend in ("sage8", "sdpa"):
            kern, whole = timers.get(("kernel", backend, parts["heads"])), (parts["heads"],)
            if kern is None or ("pack", whole, 0) not in timers or ("unpack", whole, 0) not in timers:
                continue

            def block(fn=fn, inp=inp, kern=kern, pack=timers["pack", whole, 0], unpack=timers["unpack", whole, 0]):
                fn(*inp)
                pack()
                kern()
                unpack()
            variant = _split_key(row["path"])[2]
            seqs.append(({"section": "w4-seq",
                          "path": f"{row['path'].split(':')[0]}:{backend}" + (f"+{variant}" if variant else ""),
                          "mode": row["mode"], "rows": parts["s_local"], "heads": parts["heads"],
                          "overlap_chunks": 1}, block))
    _time_rounds(seqs, args, dev, budget, args.compile_reserve_s)
    a2a = parts["a_in_ms"] + parts["a_out_ms"]
    for row, block in seqs:
        if row.get("status") != "error":
            compute = row.pop("median_ms")
            row.update(status="ok", compute_ms=compute, a2a_ms=a2a, median_ms=compute + a2a,
                       step_s=(compute + a2a) * args.step_blocks / 1e3)
            if not budget.expired(reserve_s=args.compile_reserve_s):
                # one profiled run: the time its kernels ran, and the time the GPU sat between them
                try:
                    with torch.no_grad():
                        row["busy_ms"], row["idle_ms"] = device_timeline_ms(block, dev)
                except Exception as exc:  # noqa: BLE001 - the timing stands without the profile
                    row["profile_error"] = describe_exception(exc)
        rows.append(row)
        print(row, flush=True)


def w4_rows(args, parts: dict, rest: dict, rows) -> None:
    """One modeled row per (precision, mode of the block's rest, attention backend, chunks C).

    The attention layer is ``benchmarks.scaling``'s model: C = 1, pack + A_in + kernel + A_out +
    unpack; C > 1, the chunks pipelined against their all-to-alls (:func:`overlapped_ms`)."""
    a_in, a_out = parts["a_in_ms"], parts["a_out_ms"]
    for (prec, mode), rest_ms in sorted(rest.items()):
        for (backend, C, chunking), ch in parts["chunks"].items():
            ks = ch["kernel_ms"]
            row = {"section": "w4", "path": f"{prec}:{backend}", "mode": mode, "rows": parts["s_local"],
                   "heads": parts["heads"], "overlap_chunks": C, "chunking": chunking,
                   "widths": ch["widths"]}
            if isinstance(ks, str):
                row.update(status="unavailable", reason=ks)
            else:
                if C == 1:
                    layer = ch["pack_ms"] + a_in + ks[0] + a_out + ch["unpack_ms"]
                else:
                    layer = overlapped_ms(ch["pack_runs"], ch["unpack_chunk_ms"], a_in, a_out, ks, ch["widths"])
                comm = ch["pack_ms"] + a_in + a_out + ch["unpack_ms"]
                block = rest_ms + layer
                row.update(status="ok", median_ms=block, rest_ms=rest_ms, kernel_ms=sum(ks),
                           kernel_chunk_ms=ks, pack_ms=ch["pack_ms"], pack_runs=ch["pack_runs"],
                           unpack_ms=ch["unpack_ms"], unpack_chunk_ms=ch["unpack_chunk_ms"],
                           a2a_in_ms=a_in, a2a_out_ms=a_out, comm_ms=comm,
                           hidden_ms=sum(ks) + comm - layer, step_s=block * args.step_blocks / 1e3)
            rows.append(row)


def run_accuracy(args, cfg, dev, emulate, budget, rows, mode: str = "eager", state: dict | None = None) -> dict:
    """Final latents of the served engine, per path, against bf16+sdpa: the eager paths, or
    (``mode="compiled"``, after the compiled block rows so that their timing sees no compiled
    engine before it) the ``--acc-compiled`` ones, given the eager call's returned ``state``."""
    from dist_attn import PhaseTimer
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.fp8 import quantize_linears
    from dist_attn.models.h3.serve.config import apply_overrides
    from dist_attn.models.h3.serve.h3.engine import Engine
    from dist_attn.models.h3.serve.config.sections import COMPILED_SEQUENCE_BUCKET
    from dist_attn.models.h3.serve.h3.model import build_h3, compile_blocks, parallelize
    from dist_attn.models.h3.serve.jobs.requests import parse_request

    acc = apply_overrides(cfg, {"model.num_layers": args.acc_layers})
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=dev, backend=None, shared_gpu=False)
    state = state if state is not None else {"ref": None, "eager": {}}
    model, ref_block0, quantized = None, None, "bf16"
    eager_latents: dict[str, dict] = state["eager"]
    if mode == "eager":
        paths = [(prec, backend) for prec, backend in (
            ("bf16", "sdpa"), ("bf16", "sage8"), ("fp8", "sdpa"), ("fp8", "sage8"), ("fp8fast", "sage8"),
            ("fp8fastunfused", "sage8"), ("fp8tfast", "sage8"))]
        if any(k.startswith("fp8fastadaln:") for k in _names(args.compiled) + _names(args.acc_compiled)):
            paths.append(("fp8fastadaln", "sage8"))  # last, and only when asked for (the rows stay comparable)
        reserve = args.reserve_s / 2
    else:  # compile_blocks cannot be undone: each compiled path builds its own model
        paths = [tuple(path.split(":")) for path in _names(args.acc_compiled)]
        reserve = 3 * args.compile_reserve_s  # an engine's two step shapes, and its kernels' JIT
    for prec, backend in paths:
        row = {"section": "accuracy", "path": f"{prec}:{backend}", "mode": mode,
               "layers": args.acc_layers, "steps": args.acc_steps}
        reason = _unavailable(backend, dev, cfg) or _recipe_unavailable(prec, emulate)
        if reason or budget.expired(reserve_s=reserve):
            row.update(status="unavailable" if reason else "skipped", reason=reason or _SKIPPED)
            rows.append(row)
            continue
        try:
            if model is not None and (mode == "compiled" or quantized not in ("bf16", prec)):
                model = None  # another FP8 recipe, or a model to compile
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if model is None:  # the same weights each time (configs' weight_seed)
                model, quantized = build_h3(acc.model, device=dev, dtype=torch.bfloat16), "bf16"
            if prec != quantized:  # in place, after the bf16 paths
                _quantize(model, prec, emulate)
                quantized = prec
            timer = PhaseTimer(dev)
            # compiled as served: the sequence padded to the server's bucket
            handle = parallelize(model, backend=backend, timer=timer, sequence_bucket=(
                COMPILED_SEQUENCE_BUCKET if mode == "compiled" else 1))
            block0: list[torch.Tensor] = []  # the first block's output at the first step
            hook = None
            if mode == "compiled":  # as the server: fullgraph blocks (a hook's .cpu() would break them)
                compile_blocks(model)
            else:
                def keep(_module, _args, out):
                    if not block0:
                        block0.append((out[0] if isinstance(out, tuple) else out).float().cpu())
                hook = model.transformer_blocks[0].register_forward_hook(keep)
            try:
                engine = Engine(acc, env, model, timer, backend=backend, output_dir=args.writer.out_dir)
                res = engine.run(parse_request({"steps": args.acc_steps, "seed": 0}, acc))
            finally:
                if hook is not None:
                    hook.remove()
                handle.remove()
            lat = res.latent
            if row["path"] == "bf16:sdpa" and mode == "eager":  # the reference, the first eager path
                state["ref"] = lat
            ref = state["ref"]
            if mode == "eager":
                eager_latents[row["path"]] = lat
                if row["path"] == "bf16:sdpa":
                    ref_block0 = block0[0]
                if ref_block0 is not None:
                    row["block0_rel_l2"] = _rel(block0[0], ref_block0)
            elif row["path"] in eager_latents:  # what compiling changes, beside the eager run
                twin = eager_latents[row["path"]]
                row.update(video_vs_eager_rel_l2=_rel(lat["video"], twin["video"]),
                           audio_vs_eager_rel_l2=_rel(lat["audio"], twin["audio"]))
            # compiled, the first two steps compile (step 1 has one distinct timestep, the later
            # steps two: another shape; one H100, 2026-12-06): from --acc-steps 3 the last is steady
            steps = res.step_latency_ms
            row.update(status="ok", steps_ms=steps, used=res.tokens.used,
                       median_ms=statistics.median(steps) if mode == "eager" else steps[-1])
            if ref is not None:  # no reference when bf16:sdpa did not run
                row.update(video_rel_l2=_rel(lat["video"], ref["video"]),
                           audio_rel_l2=_rel(lat["audio"], ref["audio"]))
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", reason=describe_exception(exc))
        rows.append(row)
        print(row, flush=True)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return state


def _split_key(key: str) -> tuple[str, str, str, bool]:
    """``<linears>:<attention>[+<variant>][@w4]`` -> (linears, attention, variant or "", whether
    it is the rest at W = 4's rows)."""
    prec, _, rest = key.partition(":")
    attn, _, variant = rest.removesuffix("@w4").partition("+")
    return prec, attn, variant, rest.endswith("@w4")


def _names(arg: str) -> list[str]:
    return [n for n in arg.split(",") if n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="config TOML (default configs/h3.toml; tiny with --smoke)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--compiled", default=_COMPILED,
                   help="precision:attention block rows that also run compiled, in this order (each "
                        "compiles ~10-20 s on an H200); 'none@w4' = the block's rest at 9,504 rows")
    p.add_argument("--sections", default="gemm,block,w4,accuracy")
    p.add_argument("--bandwidth-gbs", type=float, default=360.0, help="all-to-all bandwidth of the w4 model")
    p.add_argument("--overlap", default="1,2,4",
                   help="overlap_chunks C of the w4 model, comma-separated (1 = the plain path)")
    p.add_argument("--step-blocks", type=int, default=50, help="blocks per modeled denoise step")
    p.add_argument("--profile", default="",
                   help="block paths (e.g. fp8fast:sage8) whose kernels are listed, in each mode: where "
                        "the time goes, by torch.profiler over 3 calls after the timing")
    p.add_argument("--acc-layers", type=int, default=8, help="blocks of the accuracy model (steps: --acc-steps)")
    p.add_argument("--acc-steps", type=int, default=3)
    p.add_argument("--acc-compiled", default="fp8fast:sage8",
                   help="accuracy paths (linears:attention) also run with compiled blocks, as served on CUDA "
                        "('' for none; whatever --modes says); each builds and compiles its own model, at the "
                        "end of the run (needs ~3 x --compile-reserve-s of budget left); its step ms is the "
                        "last step's (steady from --acc-steps 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="passes over the compiled blocks and the w4 parts, each timing every path in turn "
                        "(median of the rounds' medians: a drift over the run falls on all paths alike)")
    p.add_argument("--reserve-s", type=float, default=150.0, help="budget kept from the eager rows")
    p.add_argument("--compile-reserve-s", type=float, default=20.0, help="budget a compiled row needs")
    add_common_args(p, iters=10, warmup=2, budget_s=270)
    args = p.parse_args(argv)
    for key in _names(args.compiled):
        if "@w4" in key and not key.endswith("@w4"):
            p.error(f"--compiled entry {key!r}: '@w4' comes last (e.g. fp8fast:none+mk@w4)")
        prec, attn, variant, at_w4 = _split_key(key)
        if variant not in _VARIANTS:
            p.error(f"--compiled entry {key!r}: '+{variant}' is not one of "
                    f"{', '.join('+' + v for v in _VARIANTS if v)}")
        if prec not in _PRECISIONS or attn not in _ATTN + _ATTN_OPT_IN or (at_w4 and attn != "none"):
            p.error(f"--compiled entry {key!r} must be <linears>:<attention> with linears one of "
                    f"{', '.join(_PRECISIONS)} and attention one of {', '.join(_ATTN + _ATTN_OPT_IN)}, or "
                    "<linears>:none@w4 (the block's rest at W = 4's rows)")
    for key in _names(args.acc_compiled):
        prec, _, attn = key.partition(":")
        if prec not in _PRECISIONS or attn not in ("sdpa", "sage8", "fa3") + _ATTN_OPT_IN:
            p.error(f"--acc-compiled entry {key!r} must be <linears>:<attention> with linears one of "
                    f"{', '.join(_PRECISIONS)} and attention one of sdpa, sage8, fa3, "
                    f"{', '.join(_ATTN_OPT_IN)} (the served engine's)")
    args.overlap = [int(c) for c in _names(args.overlap)]
    from diffusers.utils import logging as diffusers_logging

    from dist_attn.models.h3.fp8.linear import fp8_unsupported_reason
    from dist_attn.models.h3.serve.config import load_config

    diffusers_logging.set_verbosity_error()  # one "experimental" warning per backend switch
    dev = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    path = args.config or os.path.join(_REPO, "configs", "tiny.toml" if args.smoke else "h3.toml")
    cfg = load_config(path)
    smoke_values(p, args, argv, iters=2, warmup=1, reserve_s=0.0, compile_reserve_s=0.0, rounds=2, acc_layers=2,
                 acc_steps=2)
    if args.smoke:
        args.layout = cfg.layout(frames=cfg.request.frames, height=cfg.request.height, width=cfg.request.width)
    else:
        args.layout = h3_ref_layout()
    total = padded_total(args.layout.used)
    args.gemm_rows = [total, total // 4]  # h3-ref: 38,016 and 9,504
    reason = fp8_unsupported_reason(dev)
    if reason and not args.smoke:
        p.error(f"FP8 linears cannot run here ({reason}); --smoke runs the float32 emulation on CPU")
    emulate = reason is not None  # --smoke on CPU only
    args.emulate = emulate
    budget = Budget(args.budget_s or None)
    sections, modes = _names(args.sections), _names(args.modes)
    writer = ResultWriter(theme=THEME, args=args, device=dev,
                          title="FP8 linear layers on the real H3 block (W = 1, W = 4 modeled) and its latents",
                          config={"config_file": os.path.relpath(path, _REPO), "model": cfg.to_dict()["model"],
                                  "used": args.layout.used, "total": total, "gemm_rows": args.gemm_rows,
                                  "sections": sections, "modes": modes, "compiled": _names(args.compiled),
                                  "fp8": "emulated (float32)" if emulate else "torchao Float8DynamicActivation"
                                         "Float8WeightConfig(PerRow), fp32 accumulation",
                                  "bandwidth_gbs": args.bandwidth_gbs, "step_blocks": args.step_blocks,
                                  "overlap_chunks": args.overlap, "rounds": args.rounds,
                                  "accuracy": {"layers": args.acc_layers, "steps": args.acc_steps,
                                               "compiled": _names(args.acc_compiled)},
                                  "compile": "torch.compile(block, fullgraph=True, dynamic=False)"})
    args.writer = writer
    rows, rest, parts = writer.rows, {}, None
    summary, models = _models(cfg, dev, emulate)
    writer.note(f"quantize_linears on the block: {summary.describe()}")
    if "gemm" in sections:
        run_gemm(args, cfg, dev, emulate, budget, rows)
    if "eager" in modes and ("block" in sections or "w4" in sections):
        run_blocks(args, cfg, dev, models, budget, rows, "eager", rest)
    if "w4" in sections:
        parts = measure_w4_parts(args, cfg, dev, budget)
        if "compiled" not in modes:
            parts.pop("timers")  # only the compiled w4-seq rows use them; their buffers go now
    accuracy = None
    if "accuracy" in sections:
        accuracy = run_accuracy(args, cfg, dev, emulate, budget, rows, "eager")
    if "compiled" in modes and ("block" in sections or "w4" in sections):
        run_blocks(args, cfg, dev, models, budget, rows, "compiled", rest, on_live=None if parts is None else
                   (lambda live: run_w4_sequence(args, parts, live, dev, budget, rows)))
    if parts is not None:
        parts.pop("timers", None)
        w4_rows(args, parts, rest, rows)
        writer.payload["w4_rounds_ms"] = parts["rounds"]
    if accuracy is not None and _names(args.acc_compiled):  # last: no compiled engine before the timings
        run_accuracy(args, cfg, dev, emulate, budget, rows, "compiled", accuracy)
    writer.payload["targets"] = targets(rows)
    print(writer.finish(plot(writer), report(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
