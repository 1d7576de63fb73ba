# SPDX-License-Identifier: Apache-2.0
"""The MiniMax-H3 text-to-video+audio pipeline (``t2va``) as the server runs it, built from
diffusers 0.42.1's own modular blocks (``diffusers/modular_pipelines/minimax_h3/``).

Where each part runs (measured in ``benchmarks/pipeline_placement.py``; the numbers are in the
README's "Serve H3" section):

- **Text encoder (Qwen3-VL) on rank 0, its output broadcast.** The encoder is as large as the
  DiT (H3 reads layer 50 of a 5,120-wide Qwen3-VL), so one copy instead of W saves (W - 1)
  copies of its weights, and rank 0's copy makes the ranks agree by construction. The broadcast
  is one [1, T, 5120] tensor (5 MB at 512 bf16 tokens): far below the encoder's own time, and the
  other ranks would wait for an encoder of their own just as long. With
  ``parallel.shard_weights`` the encoder is sharded over every rank instead (FSDP2, one decoder
  layer gathered at a time): every rank holds 1/W of it and runs it on the same prompt (its
  layers' gathers are collectives), and rank 0's output is still the one broadcast.
- **Transformer on every rank**, sequence-parallel through ``enable_ulysses``: every rank calls
  it with the same full inputs and gets the same full outputs.
- **Video VAE decode on every rank, audio decode and muxing on rank 0**
  (:mod:`dist_attn.models.h3.serve.h3.decode`). Every rank already holds the denoised latents (the
  transformer's outputs are gathered); the video's (clip, tile) decoder calls are dealt over the
  ranks (:func:`dist_attn.integrations.diffusers.enable_parallel_decode`, float16 on CUDA) and
  rank 0 encodes each clip's frames while later ones decode. The audio VAE (~0.05 s) stays on
  rank 0; the other ranks hold it on the meta device: the layout blocks read its geometry
  (sample rate, latent channels), never its weights.

The denoise loop is diffusers' own loop body (``MiniMaxH3LoopDenoiser`` + ``MiniMaxH3LoopScheduler
Step``) inside a loop of ours that, after every step, asks a hook whether to go on: rank 0 times
the step and votes (cancel, shutdown), every rank takes part in the one all-reduce that decides,
so all ranks stop at the same step.

Adaptations, each because of a fact of diffusers or transformers that a tiny CPU run meets:

- The layout blocks read the VAEs' geometry through the pipeline's properties but do not declare
  the VAEs as components; without them they silently use the released checkpoint's numbers (24
  latent channels, ...). :class:`ServedDenoise` declares ``vae`` and ``audio_vae``.
- transformers' ``Qwen3VLProcessor`` cannot be built without torchvision (its video processor
  needs it); ``t2va`` uses the processor for ``create_mm_token_type_ids`` alone, which for a text
  prompt marks no token. Where torchvision is missing, :class:`TextOnlyQwen3VLProcessor` (a
  ``ProcessorMixin`` over the same tokenizer, running transformers' own
  ``create_mm_token_type_ids``) stands in, and the log says so.
- ``fl2va`` (keyframes) is not served: it needs image upload in the API, the VAE encoder, and
  the image processor (torchvision again); the blocks would make it cheap once those exist.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.h3.components import (H3Components, check_fit, checkpoint_is_tiny,
                                                     load_components)
from dist_attn.models.h3.serve.h3.decode import JobDecoder
from dist_attn.models.h3.serve.h3.denoise import DenoiseHook, ServedDenoise
from dist_attn.models.h3.serve.h3.tiny import ensure_tiny_checkpoint
from dist_attn.models.h3.serve.jobs.runner import StepHook, VideoOutcome
from dist_attn.models.h3.serve.jobs.videos import VideoRequest, VideoRules
from dist_attn.models.h3.serve.wire.abort import Abort, agree_abort
from dist_attn.models.h3.serve.wire.prompt import broadcast_prompt, broadcast_text

__all__ = ["H3Pipeline", "H3Runner"]

log = logging.getLogger(__name__)


class H3Pipeline:
    """The three parts of t2va over one rank's :class:`H3Components`: text encoding (rank 0),
    the sequence-parallel denoise (every rank), decoding (the video on every rank, the audio and
    the MP4 on rank 0)."""

    def __init__(self, comps: H3Components, env: DistEnv, dtype: torch.dtype, *,
                 decode_tiles_per_call: int | None = None, decode_compile: bool = False) -> None:
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

        self.comps, self.env, self.dtype = comps, env, dtype
        self.denoise = ServedDenoise().init_pipeline()
        self.denoise.update_components(transformer=comps.transformer, scheduler=comps.scheduler,
                                       audio_scheduler=comps.audio_scheduler, vae=comps.vae,
                                       audio_vae=comps.audio_vae)
        self.text = None
        # a sharded encoder runs on every rank (its layers' gathers are collectives), on rank 0's
        # prompt: the other ranks' requests carry none (a job's control message holds integers)
        self.text_everywhere = env.rank != 0 and comps.text_encoder is not None
        self.text_sharded = env.distributed and comps.text_encoder is not None and any(
            isinstance(p, DTensor) for p in comps.text_encoder.parameters())
        if comps.text_encoder is not None:
            self.text = MiniMaxH3TextEncoderStep().init_pipeline()
            self.text.update_components(text_encoder=comps.text_encoder,
                                        tokenizer=comps.tokenizer, processor=comps.processor)
        p = self.denoise
        self.decoder = JobDecoder(comps.vae, comps.audio_vae if env.rank == 0 else None, env,
                                  pixel_mean=p.pixel_mean, pixel_std=p.pixel_std, fps=p.fps,
                                  tiles_per_call=decode_tiles_per_call, compile=decode_compile)

    def rules(self, *, max_steps: int, max_rows: int, default_steps: int,
              default_height: int | None = None, default_width: int | None = None) -> VideoRules:
        """What this pipeline accepts, read from its components (rank 0: it needs the
        tokenizer). Defaults: H3's 16:9 canvas unless given."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

        p = self.denoise
        tok = self.comps.tokenizer
        multiple = p.canvas_multiple
        if default_height is None or default_width is None:
            default_height, default_width = resolve_canvas_size(16, 9, multiple, 768, 768 * 1344)
        return VideoRules(
            canvas_multiple=multiple, spatial_compression=p.vae_spatial_compression_ratio,
            patch=tuple(p.patch_size), frames_per_chunk=p.vae_frames_per_chunk,
            latents_per_chunk=p.vae_latents_per_chunk, fps=p.fps, min_duration_s=p.min_duration,
            max_duration_s=p.max_duration, audio_channels=p.audio_channels,
            default_height=default_height, default_width=default_width,
            default_frames=124, default_steps=default_steps, max_steps=max_steps,
            max_rows=max_rows,
            text_rows=lambda prompt: len(tok(prompt, add_special_tokens=False)["input_ids"]))

    def _sync(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def encode(self, prompt: str | None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Rank 0 encodes ``prompt`` (with a sharded encoder every rank runs it, on rank 0's
        ``prompt``, which is broadcast first: the other ranks' is ignored); every rank gets rank
        0's result. Returns (embeds [1, T, D], tags [T], seconds of the encoder on rank 0 (0
        elsewhere))."""
        embeds = tags = None
        seconds = 0.0
        if self.text_sharded:
            prompt = broadcast_text(prompt if self.env.rank == 0 else None, self.env)
        if self.env.rank == 0 or self.text_everywhere:
            t0 = time.perf_counter()
            out = self.text(prompt=prompt, output=["prompt_embeds", "text_token_tags"])
            embeds, tags = out["prompt_embeds"], out["text_token_tags"]
            self._sync()
            seconds = time.perf_counter() - t0 if self.env.rank == 0 else 0.0
            if self.env.rank != 0:
                embeds = tags = None  # rank 0's, broadcast below, is what every rank uses
        embeds, tags = broadcast_prompt(embeds, tags, self.env, dtype=self.dtype,
                                        device=self.env.device)
        return embeds, tags, seconds

    def run_denoise(self, req: VideoRequest, embeds: torch.Tensor, tags: torch.Tensor,
                    hook: DenoiseHook) -> dict[str, Any]:
        """Every rank: diffusers' layout, noise, timesteps, our loop, the unpack. Returns the
        pipeline state's ``latents``, ``audio_latents``, ``aborted``, ``steps_done``."""
        gen = torch.Generator(device=self.env.device).manual_seed(req.seed)
        # H3's scheduler counts grid points, the terminal 0 included: n points, n - 1 forwards.
        # A request's steps are forwards (what progress counts), so the grid has one more.
        return self.denoise(prompt_embeds=embeds, text_token_tags=tags.cpu(), height=req.height,
                            width=req.width, num_frames=req.frames,
                            num_inference_steps=req.steps + 1, generator=gen, step_hook=hook,
                            output=["latents", "audio_latents", "aborted", "steps_done"])


class H3Runner:
    """:class:`dist_attn.models.h3.serve.jobs.runner.VideoRunner` over :class:`H3Pipeline`."""

    def __init__(self, pipe: H3Pipeline, rules: VideoRules | None) -> None:
        self.pipe = pipe
        self.env = pipe.env
        self.rules = rules if rules is not None else VideoRules()

    @classmethod
    def build(cls, cfg: Any, env: DistEnv, *, dtype: torch.dtype, backend: str,
              checkpoint: str | None, transformer: Any = None,
              shard_text: bool = False) -> "H3Runner":
        """Loads ``checkpoint`` (or the tiny random one, built once into the cache) on every
        rank, makes the transformer sequence-parallel, and reads the request rules.
        ``shard_text``: the text encoder sharded over every rank (with ``parallel.shard_weights``)
        instead of whole on rank 0."""
        if checkpoint is None:
            served = dict(transformer.config) if transformer is not None else None
            keys = set(cfg.model.diffusers_config()) if transformer is not None else set()
            checkpoint = ensure_tiny_checkpoint(
                env, {k: v for k, v in served.items() if k in keys} if served else None)
        comps = load_components(checkpoint, device=env.device, dtype=dtype, rank0=env.rank == 0,
                                transformer=transformer, shard_text=shard_text and env.distributed)
        check_fit(comps, checkpoint)
        if env.distributed and transformer is None:  # never compiled here: no sequence bucket
            from dist_attn.integrations.diffusers import enable_ulysses

            enable_ulysses(comps.transformer, backend=backend,
                           overlap_chunks=cfg.parallel.overlap_chunks)
        pipe = H3Pipeline(comps, env, dtype, decode_tiles_per_call=cfg.decode.tiles(),
                          decode_compile=cfg.decode.compiled(env.device.type, cfg.runtime.quality))
        rules = None
        if env.rank == 0:
            tiny = checkpoint_is_tiny(checkpoint)
            rules = pipe.rules(max_steps=cfg.serve.max_steps, max_rows=cfg.serve.max_tokens,
                               default_steps=cfg.request.steps,
                               default_height=64 if tiny else None,
                               default_width=64 if tiny else None)
        log.info("H3 pipeline from %s on %s (%s): text encoder %s, audio decode and MP4 on rank "
                 "0, transformer and video decode on %d rank(s)", checkpoint, env.device,
                 str(dtype).removeprefix("torch."), "sharded over every rank" if pipe.text_sharded
                 else "on rank 0", env.world_size)
        return cls(pipe, rules)

    def _hook(self, on_step: StepHook | None) -> DenoiseHook:
        """The loop's hook: rank 0 times the step and votes; every rank joins the all-reduce
        that decides (none after the last step)."""
        last = [time.perf_counter()]
        times: list[float] = []

        def hook(k: int, n: int) -> Abort:
            self.pipe._sync()
            now = time.perf_counter()
            times.append(now - last[0])
            vote = on_step(k, times[-1]) if on_step is not None else Abort.NONE
            verdict = agree_abort(vote, self.env) if k < n else Abort.NONE
            last[0] = time.perf_counter()
            return verdict

        hook.times = times  # type: ignore[attr-defined]
        return hook

    def lead(self, req: VideoRequest, *, mp4_path: str, png_path: str | None,
             on_step: StepHook) -> VideoOutcome:
        pipe = self.pipe
        embeds, tags, text_s = pipe.encode(req.prompt)
        hook = self._hook(on_step)
        t0 = time.perf_counter()
        out = pipe.run_denoise(req, embeds, tags, hook)
        denoise_s = time.perf_counter() - t0
        outcome = VideoOutcome(aborted=out["aborted"], step_s=list(hook.times),
                               timings={"text_encode": text_s, "denoise": denoise_s})
        if outcome.aborted is not Abort.NONE:
            return outcome
        # Every rank decodes (the other ranks in follow()); a video decode failure raises on
        # every rank alike and fails this job, rank 0's audio or encoder alone fails it here.
        try:
            done = pipe.decoder.decode(out["latents"], out["audio_latents"], mp4_path=mp4_path,
                                       png_path=png_path)
        except Exception as e:  # noqa: BLE001 - raised on every rank alike: the job fails
            log.exception("%s: the video decode failed", os.path.basename(mp4_path))
            outcome.error = f"decoding the video failed ({type(e).__name__})"
            return outcome
        outcome.timings.update(done.timings)
        outcome.file, outcome.error = done.file, done.error
        return outcome

    def follow(self, req: VideoRequest) -> None:
        embeds, tags, _ = self.pipe.encode(req.prompt)  # runs only with a sharded encoder
        out = self.pipe.run_denoise(req, embeds, tags, self._hook(None))
        if out["aborted"] is not Abort.NONE:  # the same verdict on every rank
            return
        try:
            self.pipe.decoder.decode(out["latents"], out["audio_latents"])
        except Exception:  # noqa: BLE001
            # rank 0 raised at the same point and fails the job; this rank serves on
            log.exception("the video decode failed")
