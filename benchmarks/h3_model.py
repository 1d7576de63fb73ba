# SPDX-License-Identifier: Apache-2.0
"""The real H3 on one GPU (W = 1): diffusers' MiniMaxH3Transformer3DModel, its own init, bf16
(fp32 modules as the class declares), at h3-ref (512 text + 172 audio + 37,296 video = 37,980 rows).

Sections (every path in every mode is one row; a path that cannot run is a row that says why):

* ``block``: one ``MiniMaxH3TransformerBlock`` (``transformer_blocks[0]``), plus ``none`` (attention
  replaced by an empty output: the block's rest, what compilation can fuse);
* ``model``: the forward of ``--layers`` blocks (default 4) + the 2-block token refiner;
* ``refiner``: the token refiner alone over the text rows (why it runs unsharded);
* ``overhead``: ``enable_ulysses(backend=b)`` against the same kernel called from a processor
  with diffusers' math directly (``dist_attn.sage_varlen(backend=b)``), model forward, eager,
  A/B interleaved (target <= 1%);
* ``serve``: the served engine's steady step (``--serve-layers`` 8 blocks x ``--serve-steps`` 3,
  the default request of configs/h3.toml: 38,222 rows by H3's rules).

Paths: ``ulysses:<b>`` = ``enable_ulysses(model, backend=b)`` with dist_attn's ``sdpa``, ``fa3``,
``sage8``; ``diffusers:<name>`` = ``model.set_attention_backend(name)`` (``native``,
``_native_cudnn``, ``_sage_qk_int8_pv_fp8_cuda_sm90`` when SageAttention 2 is importable). Modes:
``eager`` for every path, ``compiled`` (``compile_repeated_blocks(fullgraph=True)``: every block
and refiner block) for ``--compiled-paths``. The budget is spent in that order of priority: eager,
refiner, overhead, serve (keeping ``--reserve-s`` for what follows), compiled.

    python -m benchmarks.h3_model                 # one H200 (about 3.5 minutes: --budget-s 190)
    python -m benchmarks.h3_model --smoke         # CPU, the tiny config, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.h3_block import attach, block_inputs, h3_ref_layout, model_inputs
from benchmarks.harness import (Budget, ResultWriter, add_common_args, describe_exception,
                                markdown_table, smoke_values, time_fn)

__all__ = ["main"]

THEME = "h3-model"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATHS = ("ulysses:sdpa", "ulysses:fa3", "ulysses:sage8", "diffusers:native", "diffusers:_native_cudnn",
          "diffusers:_sage_qk_int8_pv_fp8_cuda_sm90")
_SKIPPED = "skipped: the --budget-s wall-time budget was spent"


class _NoAttention(torch.nn.Module):
    """Allocates the attention output and computes nothing."""

    def forward(self, q, k, v, **kwargs):
        return torch.empty_like(q)


class _DirectKernel:
    """diffusers' H3 processor math with the attention call replaced by the dist_attn kernel
    itself (``sage_varlen`` over one segment): what enable_ulysses is measured against."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        from dist_attn import sage_varlen
        from dist_attn.integrations.diffusers._minimax_h3 import _rotate

        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))  # [B, S, H, D]
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        s = q.shape[1]
        out = torch.stack([sage_varlen(q[b], k[b], v[b], None, s, [0, s], backend=self.backend)
                           for b in range(q.shape[0])])  # B x [S, H, D] -> [B, S, H, D]
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def _config(args):
    from dist_attn.models.h3.serve.config import apply_overrides, load_config

    path = args.config or os.path.join(_REPO, "configs", "tiny.toml" if args.smoke else "h3.toml")
    return path, apply_overrides(load_config(path), {"model.num_layers": args.layers})


def _build(cfg, dev, dtype):
    from dist_attn.models.h3.serve.h3.model import build_h3

    return build_h3(cfg.model, device=dev, dtype=dtype)


class _Paths:
    """Puts the model on one attention path and takes it off again."""

    def __init__(self, model, seq_len: int) -> None:
        self.model, self.seq_len, self.handle = model, seq_len, None

    def enter(self, path: str) -> None:
        kind, name = path.split(":", 1)
        if kind == "ulysses":
            from dist_attn import resolve_backend
            from dist_attn.integrations.diffusers import enable_ulysses

            probe = torch.empty(1, self.model.config.num_attention_heads,
                                self.model.config.attention_head_dim,
                                dtype=self.model.transformer_blocks[0].attn.to_q.weight.dtype,
                                device=self.model.device)
            resolve_backend(name, probe)  # raises with the reason when it cannot run here
            self.handle = enable_ulysses(self.model, backend=name)
        elif kind == "diffusers":
            self.model.set_attention_backend(name)  # raises when its kernel is not importable
        elif kind == "direct":
            for block in self.model.transformer_blocks:
                block.attn.set_processor(_DirectKernel(name))
        else:
            raise ValueError(f"path {path!r}: kind must be ulysses, diffusers or direct")

    def leave(self, path: str) -> None:
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        # set_attention_backend also sets diffusers' process-wide active backend, which every
        # processor without its own (the refiner's under enable_ulysses) follows: back to native.
        self.model.set_attention_backend("native")
        self.model.reset_attention_backend()
        if path.startswith("direct:"):
            for block in self.model.transformer_blocks:
                block.attn.set_processor(MiniMaxH3AttnProcessor())
        _uncompile(self.model)

    def block_call(self, args):
        """Calls ``transformer_blocks[0]`` once with the h3-ref block inputs."""
        block = self.model.transformer_blocks[0]
        if self.handle is None:
            return block(*args)
        with self.handle.sequence(self.seq_len):
            return block(*args)


def _uncompile(model) -> None:
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    torch._dynamo.reset()


def _time(fn, dev, iters, warmup, budget):
    t = time_fn(fn, device=dev, iters=iters, warmup=warmup, budget=budget)
    return {"median_ms": t.median_ms, "min_ms": t.min_ms, "iters": t.iters, "timing": t.method}


def run(args, writer, budget, cfg, dev, dtype) -> None:
    from dist_attn.models.h3.serve.config import apply_overrides

    layout = h3_ref_layout() if not args.smoke else cfg.layout(
        frames=cfg.request.frames, height=cfg.request.height, width=cfg.request.width)
    model = _build(cfg, dev, dtype)
    inputs = model_inputs(cfg.model, layout, dev, dtype)
    block_args = block_inputs(cfg.model, layout, layout.used, layout.used, 0, dev, dtype)
    paths = _Paths(model, layout.used)
    rows = writer.rows
    writer.payload["config"].update(used=layout.used, text=layout.text, audio=layout.audio,
                                    video=layout.video)
    # the block without attention (its own processor object, no path needed)
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    # ---- block and model per path: every path eager, then the compiled ones
    modes = _names(args.modes)
    for mode in modes:
        chosen = _names(args.paths if mode == "eager" else args.compiled_paths)
        for path in ["none"] + [c for c in chosen if c != "none"]:
            row_b = {"section": "block", "path": path, "mode": mode}
            row_m = {"section": "model", "path": path, "mode": mode}
            if budget.expired(reserve_s=args.reserve_s if mode == "eager" else 0):
                for r in (row_b, row_m):
                    r.update(status="skipped", reason=_SKIPPED)
                rows.extend([row_b] + ([] if path == "none" else [row_m]))
                continue
            try:
                if path == "none":
                    attach(model.transformer_blocks[0], _NoAttention(), layout.used)
                else:
                    paths.enter(path)
            except Exception as exc:  # noqa: BLE001 - a path that cannot run here is a row
                for r in (row_b, row_m):
                    r.update(status="unavailable", reason=describe_exception(exc))
                paths.leave(path)
                rows.extend([row_b] + ([] if path == "none" else [row_m]))
                continue
            try:
                if mode == "compiled":
                    model.compile_repeated_blocks(fullgraph=True)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    row_b.update(status="ok", **_time(lambda: paths.block_call(block_args), dev,
                                                      args.iters, args.warmup, budget))
                    if path != "none":
                        row_m.update(status="ok", **_time(lambda: model(**inputs, return_dict=False),
                                                          dev, args.model_iters, args.warmup, budget))
                row_b["wall_s"] = time.perf_counter() - t0  # compilation included
            except Exception as exc:  # noqa: BLE001
                for r in (row_b, row_m):
                    if r.get("status") != "ok":
                        r.update(status="error", reason=describe_exception(exc))
            finally:
                if path == "none":
                    model.transformer_blocks[0].attn.set_processor(MiniMaxH3AttnProcessor())
                    _uncompile(model)
                else:
                    paths.leave(path)
            rows.extend([row_b] + ([] if path == "none" else [row_m]))
            writer.save()
            print(row_b, "\n", row_m if path != "none" else "", flush=True)
        if mode == "eager":
            _refiner(model, inputs, dev, args, budget, rows)
            _overhead(paths, model, inputs, dev, args, budget, rows)
            writer.save()
            _serve(apply_overrides(cfg, {"model.num_layers": args.serve_layers}), dev, dtype, args,
                   budget, rows)
            writer.save()


def _refiner(model, inputs, dev, args, budget, rows) -> None:
    row = {"section": "refiner", "path": "diffusers:native", "mode": "eager"}
    if budget.expired(reserve_s=args.reserve_s):
        row.update(status="skipped", reason=_SKIPPED)
    else:
        text = model.context_embedder(inputs["encoder_hidden_states"])  # [1, N_text, hidden]
        with torch.inference_mode():
            row.update(status="ok", rows=text.shape[1],
                       **_time(lambda: model.token_refiner(text), dev, args.iters, args.warmup, budget))
    rows.append(row)


def _overhead(paths, model, inputs, dev, args, budget, rows) -> None:
    """enable_ulysses vs the same kernel from diffusers' processor, A/B interleaved."""
    for backend in _names(args.overhead_backends):
        row = {"section": "overhead", "path": f"ulysses:{backend} vs direct:{backend}", "mode": "eager"}
        if budget.expired(reserve_s=args.reserve_s):
            row.update(status="skipped", reason=_SKIPPED)
            rows.append(row)
            continue
        times: dict[str, list[float]] = {"ulysses": [], "direct": []}
        try:
            with torch.inference_mode():
                for rep in range(args.overhead_reps):
                    for kind in ("ulysses", "direct"):
                        paths.enter(f"{kind}:{backend}")
                        try:
                            t = time_fn(lambda: model(**inputs, return_dict=False), device=dev,
                                        iters=args.model_iters, warmup=1 if rep == 0 else 0)
                            times[kind].append(t.median_ms)
                        finally:
                            paths.leave(f"{kind}:{backend}")
            u, d = statistics.median(times["ulysses"]), statistics.median(times["direct"])
            row.update(status="ok", median_ms=u, direct_ms=d, overhead=u / d - 1.0,
                       ulysses_ms_all=times["ulysses"], direct_ms_all=times["direct"])
        except Exception as exc:  # noqa: BLE001
            row.update(status="unavailable", reason=describe_exception(exc))
        rows.append(row)
        print(row, flush=True)


def _serve(cfg, dev, dtype, args, budget, rows) -> None:
    """The served engine's steady step: Engine.run of the default request at W = 1."""
    from dist_attn import PhaseTimer
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.h3.engine import Engine
    from dist_attn.models.h3.serve.config.sections import COMPILED_SEQUENCE_BUCKET
    from dist_attn.models.h3.serve.h3.model import build_h3, compile_blocks, parallelize
    from dist_attn.models.h3.serve.jobs.requests import parse_request

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=dev, backend=None, shared_gpu=False)
    model = None
    for backend in _names(args.serve_backends):
        for compiled in ([False, True] if args.serve_compile else [False]):
            row = {"section": "serve", "path": f"ulysses:{backend}", "mode": "compiled" if compiled else "eager",
                   "layers": cfg.model.num_layers, "steps": args.serve_steps}
            if budget.expired(reserve_s=args.reserve_s):
                row.update(status="skipped", reason=_SKIPPED)
                rows.append(row)
                continue
            try:
                if model is None:
                    model = build_h3(cfg.model, device=dev, dtype=dtype)
                timer = PhaseTimer(dev)
                handle = parallelize(model, backend=backend, timer=timer, sequence_bucket=(
                    COMPILED_SEQUENCE_BUCKET if compiled else 1))  # as served
                if compiled:
                    compile_blocks(model)
                engine = Engine(cfg, env, model, timer, backend=backend)
                req = parse_request({"steps": args.serve_steps, "seed": 0}, cfg)
                res = engine.run(req)
                steady = res.step_latency_ms[1:] or res.step_latency_ms
                row.update(status="ok", median_ms=statistics.median(steady),
                           step_ms=res.step_latency_ms, rows=res.tokens.used,
                           attention_share=res.attention_share, checksum=res.checksum.bits64)
                handle.remove()
                _uncompile(model)
            except Exception as exc:  # noqa: BLE001
                row.update(status="unavailable", reason=describe_exception(exc))
            rows.append(row)
            print(row, flush=True)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _names(arg: str) -> list[str]:
    """A comma-separated option as a list; an empty option (``--serve-backends ""``) skips its section."""
    return [n for n in arg.split(",") if n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="config TOML (default configs/h3.toml; tiny with --smoke)")
    p.add_argument("--layers", type=int, default=4, help="blocks of the measured model (default 4)")
    p.add_argument("--paths", default=",".join(_PATHS), help="comma-separated attention paths")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--compiled-paths", default="ulysses:sdpa,ulysses:fa3,ulysses:sage8,diffusers:native",
                   help="paths that also get a compiled row (each compiles for ~10-20 s on an H200)")
    p.add_argument("--model-iters", type=int, default=5, help="timed model forwards per row")
    p.add_argument("--overhead-backends", default="sdpa,fa3,sage8")
    p.add_argument("--overhead-reps", type=int, default=2, help="A/B alternations per backend")
    p.add_argument("--serve-backends", default="sdpa,sage8")
    p.add_argument("--serve-layers", type=int, default=8)
    p.add_argument("--serve-steps", type=int, default=3)
    p.add_argument("--serve-compile", action="store_true", help="also a --compile served row")
    p.add_argument("--reserve-s", type=float, default=80.0,
                   help="budget kept for the compiled rows while the eager sections run")
    add_common_args(p, iters=8, warmup=2, budget_s=190)
    args = p.parse_args(argv)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # one "experimental feature" warning per backend switch
    dev = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    smoke_values(p, args, argv, layers=2, serve_layers=2, serve_steps=2, iters=2, model_iters=2, warmup=1,
                 overhead_reps=1, reserve_s=0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    path, cfg = _config(args)
    budget = Budget(args.budget_s or None)
    writer = ResultWriter(theme=THEME, args=args, device=dev,
                          title="The real H3 (diffusers' MiniMaxH3Transformer3DModel) on one GPU, W = 1",
                          config={"config_file": os.path.relpath(path, _REPO), "model": cfg.to_dict()["model"],
                                  "dtype": str(dtype), "world": 1, "paths": _names(args.paths),
                                  "modes": _names(args.modes), "layers": args.layers,
                                  "serve": {"layers": args.serve_layers, "steps": args.serve_steps,
                                            "backends": _names(args.serve_backends)},
                                  "compile": "compile_repeated_blocks(fullgraph=True)"})
    writer.note("Own init (nn.Linear's kaiming-uniform), blocks bf16 with the class's fp32 modules "
                "(proj_in, audio_proj_in, time_embedder, rope, proj_out, audio_proj_out). 'ulysses:*' "
                "paths run the refiner with diffusers' native attention (it is not sharded); 'none' is "
                "the block with attention replaced by an empty output.")
    run(args, writer, budget, cfg, dev, dtype)
    cols = [("section", "section", ""), ("path", "attention path", ""), ("mode", "mode", ""),
            ("status", "status", ""), ("median_ms", "ms", ".2f"), ("direct_ms", "direct ms", ".2f"),
            ("overhead", "overhead", ".4f"), ("reason", "reason", "")]
    base = {(r["section"], r["mode"]): r["median_ms"] for r in writer.rows
            if r.get("path") == "diffusers:native" and r.get("status") == "ok"}
    for r in writer.rows:
        ref = base.get((r["section"], r["mode"]))
        if ref and r.get("median_ms") and r["section"] in ("block", "model"):
            r["x_native"] = ref / r["median_ms"]
    cols.insert(5, ("x_native", "x diffusers native", ".3f"))

    def plot(plt):
        ok = [r for r in writer.rows if r["section"] in ("block", "model") and r.get("median_ms")]
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for ax, section in zip(axes, ("block", "model")):
            sel = [r for r in ok if r["section"] == section]
            ax.bar(range(len(sel)), [r["median_ms"] for r in sel],
                   color=["tab:blue" if r["mode"] == "eager" else "tab:orange" for r in sel])
            ax.set_xticks(range(len(sel)))
            ax.set_xticklabels([f"{r['path']}\n{r['mode']}" for r in sel], rotation=70, fontsize=7)
            ax.set_ylabel("ms")
            ax.set_title(f"{section} ({writer.gpu}; blue eager, orange compiled)")
        fig.tight_layout()

    print(writer.finish(plot, [("Results", markdown_table(writer.rows, cols))]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
