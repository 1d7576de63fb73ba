"""One H3 DiT block at h3-ref on one GPU (W = 1), eager against ``torch.compile``.

Rows: the block with each attention backend, and with attention replaced by a backend that only
allocates its output ("none"), which isolates what compilation does to the block's rest (QKV,
qk-norm, RoPE, modulation, MLP). Attention is one opaque custom op under compile, so the compiled
block must not graph-break on it (``fullgraph=True``).

    python -m benchmarks.compile_block                       # one GPU, h3-ref
    python -m benchmarks.compile_block --smoke               # CPU, tiny config, seconds
"""

from __future__ import annotations

import argparse
import os
import tomllib

import torch

from benchmarks.harness import (Budget, H3_REF, ResultWriter, add_common_args, describe_exception,
                                markdown_table, time_fn)
from dist_attn import AttentionBackend, register_backend, resolve_backend

__all__ = ["main"]

THEME = "compile-block"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _NoAttention(AttentionBackend):
    """Allocates the output and computes nothing: the block's cost without attention."""

    name = "none"

    def unsupported_reason(self, q):
        return None

    def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
        return torch.empty_like(q) if out is None else out


def _gemm_flop_per_row(cfg) -> int:
    """The block's GEMMs per row: QKV and output projections, and the two MLP matrices
    (H3: 2 * 5376 * (4 * 7168 + 2 * 14336) = 0.62 GFLOP)."""
    return 2 * cfg.hidden_size * (4 * cfg.inner_dim + 2 * cfg.ffn_size)


def _model_config(path: str):
    from dist_attn.serve.config import ModelConfig

    with open(path, "rb") as f:
        return ModelConfig(**tomllib.load(f)["model"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="model TOML (default configs/h3.toml; tiny with --smoke)")
    p.add_argument("--backends", default="sage8,fa3,sdpa,none")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode (default: inductor's; e.g. max-autotune-no-cudagraphs)")
    add_common_args(p, iters=10, warmup=3, budget_s=240)
    args = p.parse_args(argv)
    from dist_attn.serve.model import DiTBlock, init_weights, rope_tables

    dev = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    cfg = _model_config(args.config or os.path.join(_REPO, "configs", "tiny.toml" if args.smoke else "h3.toml"))
    used, total = (276, 320) if args.smoke else (H3_REF["used"], H3_REF["total"])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    register_backend(_NoAttention(), replace=True)
    budget = Budget(args.budget_s or None)
    writer = ResultWriter(theme=THEME, args=args, device=dev, title="One DiT block, eager vs torch.compile",
                          config={"model": cfg.name, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                                  "head_dim": cfg.head_dim, "ffn": cfg.ffn_size, "used": used,
                                  "total": total, "dtype": str(dtype), "world": 1,
                                  "compile": f"torch.compile(block, fullgraph=True, mode={args.compile_mode!r})"})
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(total, cfg.hidden_size, generator=g, device=dev).to(dtype)
    tmod = (0.02 * torch.randn(6, cfg.hidden_size, generator=g, device=dev)).to(dtype)
    rope = rope_tables(torch.arange(total, device=dev), cfg.rope_dims, cfg.rope_theta)
    bounds = [0, used, total]
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    for name in args.backends.split(","):
        try:
            resolve_backend(name, x.new_empty(1, cfg.num_heads, cfg.head_dim))
        except Exception as exc:  # noqa: BLE001 - recorded as a row with its reason
            writer.rows.append({"backend": name, "status": f"unavailable: {describe_exception(exc)}"})
            continue
        block = DiTBlock(cfg, backend=name, device=dev, dtype=dtype)
        init_weights(block, cfg.weight_seed)
        block = block.eval().requires_grad_(False)
        compiled = torch.compile(block, fullgraph=True, mode=args.compile_mode)
        row = {"backend": name, "status": "ok"}
        with torch.inference_mode():
            for mode, fn in (("eager", block), ("compiled", compiled)):
                if budget.expired():
                    row["status"] = "partial: budget spent"
                    break
                t = time_fn(lambda: fn(x, tmod, rope, cu, used, bounds), device=dev, iters=args.iters,
                            warmup=args.warmup, budget=budget)
                row[f"{mode}_ms"] = t.median_ms
        if "eager_ms" in row and "compiled_ms" in row:
            row["speedup"] = row["eager_ms"] / row["compiled_ms"]
            row["gemm_tflops_compiled"] = _gemm_flop_per_row(cfg) * total / row["compiled_ms"] / 1e9
        writer.rows.append(row)
        writer.save()
        print(row, flush=True)
        del block, compiled
    table = markdown_table(writer.rows, [("backend", "attention", ""), ("eager_ms", "eager ms", ".2f"),
                                         ("compiled_ms", "compiled ms", ".2f"), ("speedup", "speedup", ".3f"),
                                         ("status", "status", "")])
    writer.note("'none' replaces attention by an empty output: it is the block's rest (QKV, qk-norm, "
                "RoPE, modulation, MLP), the part torch.compile can fuse; attention stays one custom op.")

    def plot(plt):
        ok = [r for r in writer.rows if "eager_ms" in r and "compiled_ms" in r]
        xs = range(len(ok))
        plt.bar([i - 0.2 for i in xs], [r["eager_ms"] for r in ok], 0.4, label="eager")
        plt.bar([i + 0.2 for i in xs], [r["compiled_ms"] for r in ok], 0.4, label="torch.compile")
        plt.xticks(list(xs), [r["backend"] for r in ok])
        plt.ylabel("ms per block")
        plt.title(f"{cfg.name} block, {total} rows, {writer.gpu}")
        plt.legend()

    print(writer.finish(plot, [("Block time", table)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
