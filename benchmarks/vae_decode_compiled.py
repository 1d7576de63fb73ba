# SPDX-License-Identifier: Apache-2.0
"""The served video decode compiled against eager, at h3-ref on one GPU (W = 1): seconds and pixels.

    python -m benchmarks.vae_decode_compiled             # one H100/H200: AutoencoderKLMiniMaxH3()
    python -m benchmarks.vae_decode_compiled --smoke     # CPU: a tiny VAE, aot_eager, seconds

``AutoencoderKLMiniMaxH3()`` at its default config, its own random initialisation with the decoder
blocks' output scales drawn from N(0, 0.1) (the class starts them at zero, and zero-scaled blocks
would add nothing for compilation to change), in float16 with its float32 modules
(``from_pretrained``'s dtypes), decoded as the server decodes it: :func:`enable_parallel_decode`
(196 decoder calls at h3-ref, ``--tiles-per-call`` a call, "auto": the server's rule, 8), the
whole 124-frame 768 x 1344 video. Two copies of the VAE: eager, and with
:func:`compile_vae_decoder` (the 36 ViT blocks, ``--compile-backend``). Each is warmed by one
decode (the compiled one's first decode is its compilation, reported), then ``--rounds`` rounds
time one decode of each, alternately (a single pass drifts by ~5%); the median of each. Pixels:
both videos in [0, 1] (the decode step's conversion), the share off by more than 1/255, the
largest error, the uint8 pixels that change.

Writes ``benchmarks/results/vae-decode-compiled_<hw>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from benchmarks.harness import ResultWriter, add_common_args, markdown_table, refuse_unhonoured
from benchmarks.vae_decode import _draw_scales, _pixels, _sync, _vae

THEME = "vae-decode-compiled"


def _decode(vae, z) -> tuple[torch.Tensor, float]:
    _sync(z.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        video = vae.decode(z, return_dict=False)[0]
    _sync(z.device)
    return video, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    from dist_attn.integrations.diffusers import compile_vae_decoder, enable_parallel_decode
    from dist_attn.models.h3.serve.h3.decode import cast_like_from_pretrained, video_vae_dtype
    from dist_attn.models.h3.serve.h3.model import raise_recompile_limit

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles-per-call", type=int, default=None, help="default: the server's rule")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default: inductor on the GPU, aot_eager with --smoke)")
    add_common_args(p, iters=1, warmup=1, budget_s=None)
    args = p.parse_args(argv)
    refuse_unhonoured(p, args, smoke_on_cpu=True)
    cuda = torch.cuda.is_available() and args.device != "cpu" and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    vae = _vae(not cuda, device)
    _draw_scales(vae)
    eager = cast_like_from_pretrained(vae, video_vae_dtype(device))
    compiled = copy.deepcopy(eager)
    raise_recompile_limit()
    compile_vae_decoder(compiled, backend=backend)
    shape = (1, vae.config.latent_channels, 12, 5, 10) if not cuda else (1, 24, 37, 48, 84)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device)
    config = {"vae": "AutoencoderKLMiniMaxH3(), scales drawn" if cuda else "tiny",
              "dtype": str(video_vae_dtype(device)), "latents": list(shape),
              "compile_backend": backend, "rounds": args.rounds, "device": str(device),
              "request": "124 frames at 768 x 1344 (37 x 48 x 84 latents), W = 1" if cuda else "tiny"}
    writer = ResultWriter(theme=THEME, args=args, config=config, device=device,
                          title="H3 video decode at h3-ref, W = 1: compiled decoder blocks vs eager")
    handles = [enable_parallel_decode(v, tiles_per_call=args.tiles_per_call) for v in (eager, compiled)]
    want, eager_first = _decode(eager, z)
    got, compile_s = _decode(compiled, z)  # compiles every batch shape of the video
    px_want, px_got = _pixels(want), _pixels(got)
    err = (px_got - px_want).abs()
    pixels = {"max_abs_px": float(err.max()), "share_off_1_255": float((err > 1 / 255).float().mean()),
              "share_off_uint8": float(((px_got * 255).round() != (px_want * 255).round()).float().mean()),
              "rel_l2": float((px_got - px_want).norm() / px_want.norm())}
    del want, got, px_want, px_got, err
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, v in (("eager", eager), ("compiled", compiled)):
            video, s = _decode(v, z)
            times[name].append(s)
            del video
    med = {k: statistics.median(v) for k, v in times.items()}
    stats = handles[1].last
    rows = [{"decode": k, "s": med[k], "runs_s": times[k], "speedup": med["eager"] / med[k],
             "calls": stats.calls, "tiles_per_call": stats.tiles_per_call, "status": "ok",
             "total_ms": med[k] * 1e3} for k in ("eager", "compiled")]
    writer.rows.extend(rows)
    writer.payload["pixels"] = pixels
    writer.payload["compile_s"] = compile_s - med["compiled"]
    writer.note(f"first compiled decode {compile_s:.1f} s (eager's first {eager_first:.1f} s): "
                f"{compile_s - med['compiled']:.1f} s of compilation, paid by the server's warm-up")
    writer.note(f"pixels, compiled against eager: {pixels['share_off_1_255']:.4%} off by more "
                f"than 1/255 (max {pixels['max_abs_px']:.5f}), {pixels['share_off_uint8']:.4%} "
                f"of uint8 pixels changed, rel-L2 {pixels['rel_l2']:.2e}")
    table = markdown_table(rows, [("decode", "decode", ""), ("s", "seconds (median)", ".3f"),
                                  ("speedup", "speedup vs eager", ".2f"), ("calls", "decoder calls", "d"),
                                  ("tiles_per_call", "tiles a call", "d")])
    ptable = markdown_table([pixels], [("share_off_1_255", "pixels off > 1/255", ".4%"),
                                       ("max_abs_px", "max abs error", ".5f"),
                                       ("share_off_uint8", "uint8 pixels changed", ".4%"),
                                       ("rel_l2", "rel-L2", ".2e")])

    def plot(plt):
        plt.figure(figsize=(5, 3.5))
        plt.bar([r["decode"] for r in rows], [r["s"] for r in rows])
        plt.ylabel("seconds, whole video")
        plt.title(f"H3 video decode at h3-ref, W = 1, {writer.gpu}")

    paths = writer.finish(plot, [("Seconds", table), ("Pixels, compiled vs eager", ptable)])
    print(table)
    print(ptable)
    print(f"wrote {paths['md']}")


if __name__ == "__main__":
    main()
