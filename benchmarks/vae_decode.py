# SPDX-License-Identifier: Apache-2.0
"""The H3 video VAE decode at h3-ref: precision against float32, seconds by batch, the W = 4 decode
modeled from measured pieces, and the MP4 encode.

    python -m benchmarks.vae_decode                 # one H200: AutoencoderKLMiniMaxH3() defaults
    python -m benchmarks.vae_decode --smoke         # CPU: a tiny VAE, seconds

``AutoencoderKLMiniMaxH3()`` at its default config with the class's own random initialisation,
built on the GPU (no checkpoint). Its init leaves every decoder block's output scales at zero, so
the 36 blocks add nothing: precision is measured both so ("class init") and with the scales drawn
from N(0, 0.1) ("scales drawn"), where the blocks do contribute. Real weights were measured by
diffusers (PR #14754: float16 0 pixels off by > 1/255 against float32, bfloat16 0.057%).

Sections:

1. **precision**: 2 clips (9 latent frames) at 768 x 1344 in float32 (TF32 off), float16 and
   bfloat16 (``from_pretrained(torch_dtype=...)``'s dtypes: the class's float32 modules kept):
   max |error| in [0, 1] pixels, share of pixels off by > 1/255, rel-L2.
2. **time**: the whole h3-ref video (37 latent frames = 7 clips x 28 tiles = 196 decoder calls)
   in float16: diffusers' own decode (one tile a call), and :func:`enable_parallel_decode` at
   W = 1 with ``--tiles-per-call`` values; seconds and peak memory.
3. **W = 4 modeled**: a rank's share (49 of 196 calls) run as its batched calls, plus the
   stitching every rank does (the W = 1 decode minus its decoder calls), plus the all-gathers
   from bytes at ``--nvlink-gbs``.
4. **mux**: the 124 frames of 1344 x 768 through :class:`dist_attn.models.h3.serve.jobs.mp4.Mp4Writer`.

Writes ``benchmarks/results/vae-decode_<hw>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import tempfile
import time

import numpy as np
import torch

from benchmarks.harness import (Budget, ResultWriter, add_common_args, markdown_table,
                                refuse_unhonoured)

THEME = "vae-decode"


def _vae(smoke: bool, device: torch.device):
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(0)
    with torch.device(device):
        if smoke:
            vae = AutoencoderKLMiniMaxH3(
                latent_channels=8, block_out_channels=[8] * 6, layers_per_block=1,
                norm_num_groups=4, decoder_num_layers=2, decoder_num_attention_heads=2,
                decoder_attention_head_dim=8, decoder_num_register_tokens=1,
                latents_mean=(0.0,) * 8, latents_std=(1.0,) * 8)
            vae.enable_tiling(64, 64, 16, 16)
        else:
            vae = AutoencoderKLMiniMaxH3()
    return vae.float().eval().requires_grad_(False)


def _draw_scales(vae, std: float = 0.1) -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    for name, p in vae.decoder.named_parameters():
        if name.endswith(("scale1", "scale2")):
            p.data.copy_(torch.randn(p.shape, generator=g) * std)


def _cast(vae, dtype):
    from dist_attn.models.h3.serve.h3.decode import cast_like_from_pretrained

    return cast_like_from_pretrained(copy.deepcopy(vae), dtype)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pixels(video: torch.Tensor) -> torch.Tensor:
    """decoded ImageNet-normalised [B, 3, F, H, W] -> [0, 1] pixels in float32 (the decode
    step's conversion)."""
    mean = torch.tensor((0.485, 0.456, 0.406), device=video.device).view(1, 3, 1, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225), device=video.device).view(1, 3, 1, 1, 1)
    return (video.float() * std + mean).clamp(0, 1)


def _decode(vae, z, tiles_per_call):
    from dist_attn.integrations.diffusers import enable_parallel_decode

    with torch.no_grad():
        if tiles_per_call is None:
            return vae.decode(z, return_dict=False)[0], None
        with enable_parallel_decode(vae, tiles_per_call=tiles_per_call) as h:
            return vae.decode(z, return_dict=False)[0], h.last


def _timed(fn, device):
    torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return out, time.perf_counter() - t0, peak


def precision(vae, device, smoke, writer, rows):
    shape = (1, vae.config.latent_channels, 9, 4, 6) if smoke else (1, 24, 9, 48, 84)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for init in ("class init", "scales drawn"):
        base = vae if init == "class init" else copy.deepcopy(vae)
        if init == "scales drawn":
            _draw_scales(base)
        ref, ref_s, _ = _timed(lambda: _decode(base, z, 4)[0], device)
        ref = _pixels(ref)
        for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            low = _cast(base, dtype)
            out, s, _ = _timed(lambda: _decode(low, z, 4)[0], device)
            px = _pixels(out)
            err = (px - ref).abs()
            rows.append({"section": "precision", "init": init, "dtype": name,
                         "max_abs_px": float(err.max()),
                         "share_off_1_255": float((err > 1 / 255).float().mean()),
                         "share_off_uint8": float(((px * 255).round() != (ref * 255).round())
                                                  .float().mean()),
                         "rel_l2": float((px - ref).norm() / ref.norm()), "s": s,
                         "ref_fp32_s": ref_s})
            print(rows[-1], flush=True)
            del low, out, px, err
        writer.save()
        del ref
        torch.cuda.empty_cache() if device.type == "cuda" else None


def timing(vae16, device, smoke, tiles, rows, budget):
    shape = (1, vae16.config.latent_channels, 12, 5, 10) if smoke else (1, 24, 37, 48, 84)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    _decode(vae16, z[:, :, :7], 1)  # warm-up: kernels, allocator
    out = {}
    for tpc in [None, *tiles]:
        if budget.expired(reserve_s=60):
            rows.append({"section": "time", "status": "skipped", "reason": "--budget-s spent",
                         "tiles_per_call": tpc})
            continue
        (video, stats), s, peak = _timed(lambda: _decode(vae16, z, tpc), device)
        out[tpc] = (s, stats)
        rows.append({"section": "time", "decode": "diffusers (one tile a call)" if tpc is None
                     else "enable_parallel_decode W=1", "tiles_per_call": tpc or 1, "s": s,
                     "peak_gib": peak, "calls": stats.calls if stats else None,
                     "frames": video.shape[2]})
        print(rows[-1], flush=True)
        del video
    return z, out


def modeled_w4(vae16, z, device, tiles, w1, rows, nvlink_gbs, world=4):
    """A rank's share of the decoder calls, batched as it runs them, + the stitching + the
    all-gathers; every term measured on this GPU except the all-gather (from bytes)."""
    from dist_attn.integrations.diffusers._vae_plan import plan_decode

    plan = plan_decode(vae16, z.to(vae16.dtype))
    share = math.ceil(plan.calls / world)
    tile_bytes = math.prod(plan.tile_out) * 2  # float16
    for tpc in tiles:
        if tpc not in w1:
            continue
        lat = torch.cat([plan.latents(i) for i in range(min(tpc, share))]).to(vae16.dtype)

        def share_calls():
            with torch.no_grad():
                for k in range(0, share, tpc):
                    n = min(tpc, share - k)
                    vae16.decoder(vae16.post_quant_conv(lat[:n]))

        share_calls()
        _, rank_s, _ = _timed(share_calls, device)

        def all_calls():
            with torch.no_grad():
                for k in range(0, plan.calls, tpc):
                    n = min(tpc, plan.calls - k)
                    vae16.decoder(vae16.post_quant_conv(lat[:1].expand(n, *lat.shape[1:])))

        _, calls_s, _ = _timed(all_calls, device)
        stitch_s = max(0.0, w1[tpc][0] - calls_s)
        waves = math.ceil(plan.calls / (world * tpc))
        gather_s = (world - 1) * share * tile_bytes / (nvlink_gbs * 1e9)
        rows.append({"section": "W=4 modeled", "tiles_per_call": tpc, "rank_calls": share,
                     "rank_decoder_s": rank_s, "stitch_s": stitch_s, "all_gather_s": gather_s,
                     "waves": waves, "modeled_s": rank_s + stitch_s + gather_s,
                     "w1_decoder_calls_s": calls_s, "w1_total_s": w1[tpc][0]})
        print(rows[-1], flush=True)


def mux(device, smoke, rows, pace_s: float):
    """The MP4 of 124 frames: all at once, and streamed as the decode hands it over (7 clips,
    ``pace_s`` apart: the W = 4 decode's pace), where what counts is the tail from the last
    clip to the file committed; x264 with frame threads and with slice threads."""
    from dist_attn.models.h3.serve.jobs.mp4 import Mp4Writer

    # smoke: 28 frames (7 clips of 4) of 64 x 64 exercise the same path in a fifth of the time
    f, h, w = (28, 64, 64) if smoke else (124, 768, 1344)
    y, x = np.mgrid[0:h, 0:w]
    frames = np.stack([np.stack([(x + 3 * i) % 256, (y * 2 + i) % 256, (x * y // 7) % 256], -1)
                       for i in range(f)]).astype(np.uint8)
    audio = (0.2 * np.sin(np.arange(int(f / 24 * 32000)) / 10.0)).astype(np.float32)[None]
    audio = np.concatenate([audio, audio])
    with tempfile.TemporaryDirectory() as d:
        for threading in ("frame", "slice"):
            for clips, pace in ((1, 0.0), (7, pace_s)):
                t0 = time.perf_counter()
                wr = Mp4Writer(os.path.join(d, f"{threading}{clips}.mp4"), width=w, height=h,
                               audio=audio, sample_rate=32000, threading=threading)
                for chunk in np.array_split(frames, clips):
                    time.sleep(pace)  # the decode of the next clip
                    wr.add(chunk)
                last = time.perf_counter()
                info = wr.close()
                end = time.perf_counter()
                rows.append({"section": "mux", "threading": threading, "clips": clips,
                             "pace_s": pace, "s": end - t0, "tail_s": end - last,
                             "mb": info.size_bytes / 1e6, "cpus": os.cpu_count()})
                print(rows[-1], flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles-per-call", type=int, nargs="+", default=[4, 8, 16, 28])
    p.add_argument("--nvlink-gbs", type=float, default=360.0,
                   help="all-gather bandwidth per rank for the W = 4 model (GB/s; h3.md's "
                        "planning figure for NVLink)")
    p.add_argument("--mux-pace-s", type=float, default=None,
                   help="seconds between the 7 clips handed to the MP4 writer (default: the W = 4 "
                        "modeled decode / 7)")
    p.add_argument("--skip", nargs="*", default=[], choices=("precision", "time", "mux"))
    add_common_args(p, iters=1, warmup=1, budget_s=420)
    args = p.parse_args(argv)
    refuse_unhonoured(p, args, smoke_on_cpu=True)
    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available() and args.device != "cpu" and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    vae = _vae(not cuda, device)
    config = {"vae": "AutoencoderKLMiniMaxH3()" if cuda else "tiny", "device": str(device),
              "tiles_per_call": args.tiles_per_call, "nvlink_gbs": args.nvlink_gbs,
              "request": "124 frames at 768 x 1344 (37 x 48 x 84 latents)"}
    writer = ResultWriter(theme=THEME, args=args, config=config, device=device,
                          title="H3 video VAE decode: precision, seconds, W = 4 modeled, mux")
    rows = writer.rows
    if "precision" not in args.skip:
        precision(vae, device, not cuda, writer, rows)
    vae16 = _cast(vae, torch.float16 if cuda else torch.float32)
    del vae
    if "time" not in args.skip:
        z, w1 = timing(vae16, device, not cuda, args.tiles_per_call, rows, budget)
        writer.save()
        modeled_w4(vae16, z, device, args.tiles_per_call, w1, rows, args.nvlink_gbs)
    if "mux" not in args.skip:
        w4 = [r for r in rows if r.get("section") == "W=4 modeled"]
        mux(device, not cuda, rows, args.mux_pace_s if args.mux_pace_s is not None else
            (min(r["modeled_s"] for r in w4) / 7 if w4 else 0.22))
    for r in rows:  # the harness's row contract: a status, and the time of an ok row in ms
        if "status" not in r:
            r["status"] = "ok"
            r["total_ms"] = 1e3 * r.get("modeled_s", r.get("s", 0.0))
    sec = lambda name: [r for r in rows if r.get("section") == name and r["status"] == "ok"]  # noqa: E731
    tables = [
        ("Precision against float32 (2 clips, 768 x 1344)", markdown_table(sec("precision"), [
            ("init", "init", ""), ("dtype", "dtype", ""), ("max_abs_px", "max abs error", ".5f"),
            ("share_off_1_255", "pixels off > 1/255", ".4%"),
            ("share_off_uint8", "uint8 pixels changed", ".4%"), ("rel_l2", "rel-L2", ".2e")])),
        ("Whole video at W = 1 (float16, 196 decoder calls)", markdown_table(sec("time"), [
            ("decode", "decode", ""), ("tiles_per_call", "tiles per call", "d"),
            ("s", "seconds", ".2f"), ("peak_gib", "peak GiB", ".1f")])),
        ("W = 4 modeled (a rank's share + stitching + all-gathers)", markdown_table(
            sec("W=4 modeled"), [("tiles_per_call", "tiles per call", "d"),
                                 ("rank_decoder_s", "rank's decoder calls s", ".3f"),
                                 ("stitch_s", "stitching s", ".3f"),
                                 ("all_gather_s", "all-gathers s", ".3f"),
                                 ("modeled_s", "decode s", ".3f")])),
        ("MP4 encode (124 frames, H.264 + AAC): at once, and streamed at the W = 4 decode's pace",
         markdown_table(sec("mux"), [
             ("threading", "x264 threads", ""), ("clips", "clips handed over", "d"),
             ("pace_s", "s between clips", ".3f"), ("s", "seconds", ".2f"),
             ("tail_s", "last clip -> committed s", ".3f"), ("mb", "MB", ".2f"),
             ("cpus", "host CPUs", "d")]))]

    def plot(plt):
        t = sec("time")
        plt.figure(figsize=(7, 3.5))
        plt.bar([f"{r['decode'][:9]}\n{r['tiles_per_call']}" for r in t], [r["s"] for r in t])
        plt.ylabel("seconds, whole video")
        plt.title(f"H3 video decode at h3-ref, {writer.gpu}")

    paths = writer.finish(plot, tables)
    for _, t in tables:
        print(t)
    print(f"wrote {paths['md']}")


if __name__ == "__main__":
    main()
