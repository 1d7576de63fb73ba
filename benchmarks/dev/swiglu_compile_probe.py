# SPDX-License-Identifier: Apache-2.0
"""Dev probe: where the compiled fused SwiGLU FFN leaves the eager one (one GPU, ~1 min).

``Fp8SwiGLUFeedForward`` matched torchao's FFN to 3.4e-4 eagerly and to 3.3e-2 under
``torch.compile(fullgraph=True)`` (tests/integrations/test_fp8_gpu.py, one H100, 2026-12-06).
This compares each stage eagerly and compiled on the same input: the projection, the fused op's
codes and scales (and the strides a custom op is handed inside the compiled graph), the down
projection, the whole FFN; and torchao's FFN compiled against itself eager.

    python3 -m benchmarks.dev.swiglu_compile_probe
"""

from __future__ import annotations

import torch

__all__ = ["main"]

_SEEN: list = []


@torch.library.custom_op("swiglu_probe::record", mutates_args=())
def _record(h: torch.Tensor) -> torch.Tensor:
    _SEEN.append((tuple(h.shape), tuple(h.stride()), h.is_contiguous(), h.data_ptr() % 16))
    return h.clone()


@_record.register_fake
def _(h):
    return torch.empty_like(h)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> int:
    from diffusers.models.attention import FeedForward
    from torchao.quantization import quantize_

    from dist_attn.models.h3.fp8.linear import Fp8SwiGLUFeedForward, torchao_fp8_config
    from dist_attn.models.h3.fp8.swiglu_kernel import swiglu_e4m3_rows

    torch.manual_seed(0)
    ff = FeedForward(5376, inner_dim=14336, activation_fn="swiglu", bias=False).cuda()
    ff = ff.to(torch.bfloat16).eval().requires_grad_(False)
    quantize_(ff, torchao_fp8_config(fast_accum=False))
    down = ff.net[2].weight
    fused = Fp8SwiGLUFeedForward(ff.net[0].proj, down.qdata, down.scale, fast_accum=False)
    x = torch.randn(2, 1500, 5376, device="cuda").to(torch.bfloat16)
    out = {}
    with torch.no_grad():
        h_e = fused.proj(x)
        h_c = torch.compile(lambda t: fused.proj(t), fullgraph=True)(x)
        out["proj compiled vs eager"] = _rel(h_c, h_e)
        c_e, s_e = swiglu_e4m3_rows(h_e)
        c_c, s_c = torch.compile(lambda t: swiglu_e4m3_rows(_record(fused.proj(t))), fullgraph=True)(x)
        out["op input seen in the compiled graph (shape, stride, contiguous, ptr % 16)"] = _SEEN[-1]
        out["codes equal"] = bool(torch.equal(c_c.view(torch.uint8), c_e.view(torch.uint8)))
        out["codes differing share"] = (c_c.view(torch.uint8) != c_e.view(torch.uint8)).float().mean().item()
        out["scales equal"] = bool(torch.equal(s_c, s_e))
        out["codes / scales strides compiled"] = (tuple(c_c.stride()), tuple(s_c.stride()))

        def down_mm(c, s):
            return torch._scaled_mm(c, fused.down_codes.t(), scale_a=s, scale_b=fused.down_scales,
                                    out_dtype=torch.bfloat16, use_fast_accum=False)
        y_e = down_mm(c_e, s_e)
        y_c = torch.compile(down_mm, fullgraph=True)(c_e, s_e)
        out["down _scaled_mm compiled vs eager"] = _rel(y_c, y_e)
        want = ff(x)
        out["fused eager vs torchao eager"] = _rel(fused(x), want)
        out["fused compiled vs torchao eager"] = _rel(torch.compile(fused, fullgraph=True)(x), want)
        out["torchao compiled vs torchao eager"] = _rel(torch.compile(ff, fullgraph=True)(x), want)
        out["down scales shape / stride"] = (tuple(fused.down_scales.shape), tuple(fused.down_scales.stride()))
    for k, v in out.items():
        print(f"{k}: {v}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
