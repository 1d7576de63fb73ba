# SPDX-License-Identifier: Apache-2.0
"""The fused norm + AdaLN + FP8 quantization step against float64, on the real H3 block's inputs.

``quantize_linears(fuse_adaln="auto")`` (the default since 2026-12-07) replaces diffusers' eager
``norm1(x) * (1 + scale[idx]) + shift[idx]`` (four bf16 roundings) followed by torchao's row
quantization with one pass in float32 and one bf16 rounding. This checks both routes against
float64 on what the FIRST block of ``MiniMaxH3Transformer3DModel()`` (its own init, bf16, the
h3-ref layout: 37,980 rows x 5,376) receives: its hidden states and its AdaLN table from
``adaln_proj(temb)``. With ``--norm2`` also the block's second step (the FFN's input, on the
hidden states after the attention's residual step, which the fused path computes bit for bit as
diffusers does): that needs the block's attention, minutes on a CPU.

The fused route is :func:`dist_attn.models.h3.fp8.adaln_kernel.adaln_e4m3_rows_reference`, which the kernel
equals bit for bit under Triton's interpreter and to within one e4m3 step on 3.9e-7 of the codes
on an H100 (tests/integrations/test_fp8_gpu.py), so this runs on a CPU. Per step and route:
rel-L2 against float64 of the bf16 values before quantization and of the dequantized codes (what
the GEMM sees), and the share of codes where the routes differ. Writes
``adaln-real-accuracy.json`` (2 minutes with ``--norm2`` on a 2-core CPU).
"""

from __future__ import annotations

import time

import torch

from benchmarks.dev import probe_parser, write_probe_json

__all__ = ["main"]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def _step(x, norm, scale, shift, idx) -> dict:
    """Both routes of one norm + modulation + quantization step against float64."""
    from dist_attn.models.h3.fp8.linear import ACTIVATION_AMAX_FLOOR, quantize_rows_e4m3
    from dist_attn.models.h3.fp8.adaln_kernel import adaln_e4m3_rows_reference

    x2 = x.reshape(-1, x.shape[-1])
    rows = idx.repeat(x2.shape[0] // idx.numel())
    x64 = x2.double()
    y64 = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    y64 = y64 * (1 + scale.double().index_select(0, rows)) + shift.double().index_select(0, rows)
    # diffusers' eager ops (bf16 after each), then the unfused path's row quantization
    eager = norm(x2) * (1.0 + scale.index_select(0, rows)) + shift.index_select(0, rows)
    e_codes, e_scales = quantize_rows_e4m3(eager, amax_floor=ACTIVATION_AMAX_FLOOR)
    f_codes, f_scales = adaln_e4m3_rows_reference(x2, norm.weight, norm.eps, scale, shift, idx)
    # the fused route's one bf16 rounding: its float32 value, as the reference computes it
    xf = x2.float()
    fused_bf16 = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
                  * (1.0 + scale.float().index_select(0, rows)) + shift.float().index_select(0, rows))
    fused_bf16 = fused_bf16.to(torch.bfloat16)
    differ = (e_codes.view(torch.uint8) != f_codes.view(torch.uint8)).float().mean()
    return {"rows": x2.shape[0], "width": x2.shape[1],
            "bf16_rel_l2": {"eager": _rel(eager, y64), "fused": _rel(fused_bf16, y64)},
            "dequantized_rel_l2": {"eager": _rel(e_codes.float() * e_scales, y64),
                                   "fused": _rel(f_codes.float() * f_scales, y64)},
            "codes_differ": float(differ),
            "row_scales_differ": float((e_scales != f_scales).float().mean())}


class _Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    p = probe_parser(__doc__, iters=1)
    p.add_argument("--norm2", action="store_true", help="also the FFN's input step (runs attention)")
    args = p.parse_args(argv)  # (--iters: unused, nothing is timed)
    from dist_attn.models.h3.activations import H3_REF_LAYOUT, build_h3_model, h3_inputs

    t0 = time.perf_counter()
    model = build_h3_model(device="cpu", num_layers=1)
    inputs = h3_inputs(model, H3_REF_LAYOUT, device="cpu")
    block = model.transformer_blocks[0]
    seen: dict = {}

    def grab(module, a, kw):
        seen.update(kw)
        seen.update(zip(("hidden_states", "temb", "adaln_indices"), a))
        if not args.norm2:
            raise _Stop

    def grab_norm2(module, a):
        seen["h"] = a[0]
        raise _Stop

    hooks = [block.register_forward_pre_hook(grab, with_kwargs=True),
             block.norm2.register_forward_pre_hook(grab_norm2)]
    try:
        with torch.no_grad():
            model(**inputs)
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        shift1, scale1, _, shift2, scale2, _ = block.adaln_proj(seen["temb"])
        idx = seen["adaln_indices"]
        out = {"model": "MiniMaxH3Transformer3DModel() own init, bf16, first block",
               "layout": str(H3_REF_LAYOUT), "torch": torch.__version__,
               "norm1": _step(seen["hidden_states"], block.norm1, scale1, shift1, idx)}
        if "h" in seen:
            out["norm2"] = _step(seen["h"], block.norm2, scale2, shift2, idx)
    out["wall_s"] = time.perf_counter() - t0
    print(out)
    print(write_probe_json(args.out, "adaln-real-accuracy.json", out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
