# SPDX-License-Identifier: Apache-2.0
"""The denoise loop of the served H3, run by every rank for every request.

Every rank builds the request's packed layout, draws the same noise from the request's seed and
calls the (sequence-parallel) ``MiniMaxH3Transformer3DModel`` with the same full inputs; each gets
the same full velocity back and takes the same ``MiniMaxH3Scheduler`` step on the video rows
(shift 12) and the audio rows (shift 3), so the state stays identical on every rank (each forward
checks that it is, in one small all-gather). Between denoise steps all ranks vote on whether to go
on (:func:`dist_attn.models.h3.serve.wire.abort.agree_abort`), so a request whose client left, whose
deadline passed or that a shutdown ends stops at the same step on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dist_attn.distributed import DistEnv
from dist_attn.profiling import PhaseTimer
from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.config.tokens import PackedLayout, padded_rows
from dist_attn.models.h3.serve.h3.weights import prune_outputs, save_output
from dist_attn.models.h3.serve.jobs.requests import Request
from dist_attn.models.h3.serve.wire.abort import Abort, agree_abort

__all__ = ["Checksum", "TokenCounts", "RunResult", "Engine", "latent_checksum", "patchify",
           "initial_state"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class Checksum:
    """A checksum of the output latents (video rows, then audio rows), identical for any world
    size."""

    bits64: str
    """Hex of sum over elements of bits(x_i) * (2 i + 1) mod 2**64 (i = flat index over the video
    rows then the audio rows): exact, changes with any bit of any element."""
    sum: float
    abs_sum: float
    l2: float


@dataclass(kw_only=True, frozen=True)
class TokenCounts:
    """Packed rows of one request."""

    used: int
    """S: rows of the packed sequence (text + audio + video)."""
    total: int
    """S padded as the attention runs it: to a multiple of the world size and of the model's
    sequence bucket (``runtime.sequence_bucket``)."""
    text: int
    audio: int
    video: int
    frames: int
    """Video frames after alignment to 17 n + 5."""
    latent_shape: list[int]
    """(latent frames, latent height, latent width)."""


@dataclass(kw_only=True)
class RunResult:
    """What rank 0 reports about one request (the JSON body of a 200 answer)."""

    request_id: str
    request: dict[str, int]
    tokens: TokenCounts
    world_size: int
    backend: str
    step_latency_ms: list[float]
    denoise_ms: float
    run_ms: float
    setup_ms: float
    finalize_ms: float
    phase_ms: dict[str, float]
    attention_share: float
    all_to_all_share: float
    checksum: Checksum | None
    output: str | None = None
    """The saved latents' file name, relative to the output directory (None: not saved)."""
    queue_ms: float = 0.0
    total_latency_ms: float = 0.0
    aborted: Abort = field(default=Abort.NONE, metadata={"json": False})
    """Why the denoise loop stopped early (not part of the answer: aborted jobs get no 200)."""
    latent: dict[str, torch.Tensor] | None = field(default=None, repr=False, metadata={"json": False})
    """``{"video": [N_video, C_video], "audio": [N_audio, C_audio]}`` float32 on the CPU when an
    output directory asks for the latents."""

    def to_json(self) -> dict[str, Any]:
        """The answer body (internal fields left out)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.metadata.get("json", True)}


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def latent_checksum(video: torch.Tensor, audio: torch.Tensor) -> Checksum:
    """Checksum of the output latents (every rank holds them whole, so no collective).

    Args:
        video: ``[N_video, C_video]`` float32 video latent rows.
        audio: ``[N_audio, C_audio]`` float32 audio latent rows.
    """
    flat = torch.cat((video.float().reshape(-1), audio.float().reshape(-1)))  # video, then audio
    bits = flat.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    idx = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    # int64 products and sums wrap mod 2**64: exact and order-sensitive.
    h = int((bits * (2 * idx + 1)).sum().item()) & 0xFFFFFFFFFFFFFFFF
    xd = flat.double()
    total, abs_sum, sq = torch.stack((xd.sum(), xd.abs().sum(), xd.pow(2).sum())).tolist()
    return Checksum(bits64=f"{h:016x}", sum=total, abs_sum=abs_sum, l2=sq ** 0.5)


def patchify(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Video latents -> packed rows, frame-major then row-major (H3's pipeline order).

    Args:
        latents: ``[1, C, F, H, W]``.
        patch: ``(pt, ph, pw)`` dividing F, H, W.

    Returns:
        ``[F/pt * H/ph * W/pw, C * pt * ph * pw]``.
    """
    pt, ph, pw = patch
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # -> [B, F', H', W', C, pt, ph, pw]
    return x.reshape(-1, c * pt * ph * pw)  # -> [B * F' * H' * W', C * pt * ph * pw]


def initial_state(cfg: Config, layout: PackedLayout, seed: int, device: torch.device,
                  text_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The request's starting point, drawn from ``seed`` on ``device`` (the same on every rank).

    Returns:
        ``video`` ``[N_video, C_video]`` float32 noise (drawn as a ``[1, C, F, H, W]`` latent and
        patchified, then) ``audio`` ``[N_audio, C_audio]`` float32 noise drawn in row layout, in
        H3's pipeline draw order; then ``text`` ``[1, N_text, text_dim]`` in ``text_dtype``: a
        stand-in for the Qwen3-VL prompt embedding this server has no encoder for.
    """
    m = cfg.model
    gen = torch.Generator(device=device).manual_seed(seed)
    video = torch.randn((1, m.in_channels, *layout.latent_shape), generator=gen, device=device,
                        dtype=torch.float32)
    audio = torch.randn((layout.audio, m.audio_in_channels), generator=gen, device=device,
                        dtype=torch.float32)
    text = torch.randn((1, layout.text, m.text_dim), generator=gen, device=device,
                       dtype=torch.float32).to(text_dtype)
    return patchify(video, m.patch_size), audio, text


def _keep_going() -> Abort:
    return Abort.NONE


class Engine:
    """The denoise loop over the sequence-parallel H3; ``run`` is called on every rank."""

    def __init__(self, cfg: Config, env: DistEnv, model: torch.nn.Module, timer: PhaseTimer,
                 *, backend: str, output_dir: str | None = None) -> None:
        self.cfg, self.env, self.model, self.timer = cfg, env, model, timer
        self.backend = backend
        self.output_dir = output_dir
        self.text_dtype = model.context_embedder.weight.dtype

    def _sync(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def _schedules(self, layout: PackedLayout, steps: int) -> list[tuple[Any, ...]]:
        """Per step ``(video_t, audio_t, timestep [T], timestep_indices [S])`` on the device."""
        from diffusers import MiniMaxH3Scheduler

        dev = self.env.device
        plans = []
        for shift in (self.cfg.tokens.video_shift, self.cfg.tokens.audio_shift):
            sched = MiniMaxH3Scheduler(shift=shift)
            # the grid holds `steps + 1` sigmas with the terminal 0: `steps` model evaluations
            sched.set_timesteps(steps + 1, device=dev)
            sched.set_begin_index(0)  # no host lookup of the first timestep
            if sched.num_inference_steps != steps:
                raise RuntimeError(f"MiniMaxH3Scheduler(shift={shift}) gave {sched.num_inference_steps} "
                                   f"steps for steps={steps} (its float32 grid collapsed duplicates)")
            plans.append(sched)
        video, audio = plans
        host_v, host_a = video.timesteps.cpu().tolist(), audio.timesteps.cpu().tolist()  # once
        out = []
        for i in range(steps):
            t, idx = layout.timestep_rows(host_v[i], host_a[i])
            out.append((video.timesteps[i], audio.timesteps[i], t.to(dev), idx.to(dev)))
        return [video, audio, out]

    @torch.no_grad()
    def run(self, req: Request, *, abort: Callable[[], Abort] = _keep_going,
            text_rows: int | None = None) -> RunResult | None:
        """Denoises one request on every rank; returns the result on rank 0 (None elsewhere).

        ``abort`` is rank 0's vote before each step after the first (other ranks vote NONE; the
        caller checked just before sending the request); the loop stops on every rank at the
        first vote that is not NONE, and the result says why. ``text_rows`` replaces the
        stand-in's ``tokens.text_tokens`` (the warm-up's prompt lengths; the same on every rank).
        """
        t_start = time.perf_counter()
        layout = req.layout(self.cfg)
        if text_rows is not None:
            layout = dataclasses.replace(layout, text=text_rows)
        video, audio, step_ms, aborted, t_loop = self._denoise(req, layout, abort)
        t_denoised = time.perf_counter()
        if self.env.rank != 0:
            return None
        return self._result(req, layout, video, audio, step_ms, aborted,
                            (t_start, t_loop, t_denoised))

    def _denoise(self, req: Request, layout: PackedLayout, abort: Callable[[], Abort]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[float], Abort, float]:
        """The request's inputs on the device, then the denoise loop: before each step after the
        first every rank agrees on ``abort``'s vote, then one forward and one scheduler step per
        modality, synchronised and timed. Returns the final ``video`` and ``audio`` rows, each
        step's milliseconds, the verdict that stopped the loop (NONE: every step ran) and when
        the loop started."""
        env = self.env
        dev = env.device
        rows = {k: v.to(dev) for k, v in layout.rows().items()}
        video, audio, text = initial_state(self.cfg, layout, req.seed, dev, self.text_dtype)
        video_sched, audio_sched, plan = self._schedules(layout, req.steps)
        self.timer.reset()
        self._sync()
        t_loop = time.perf_counter()
        step_ms: list[float] = []
        aborted = Abort.NONE
        for i, (video_t, audio_t, timestep, timestep_indices) in enumerate(plan):
            if i:
                aborted = agree_abort(abort(), env)
                if aborted is not Abort.NONE:
                    break
            t0 = time.perf_counter()
            v_video, v_audio = self.model(
                hidden_states=video[None], audio_hidden_states=audio[None],
                encoder_hidden_states=text, timestep=timestep, timestep_indices=timestep_indices,
                return_dict=False, **rows)
            video = video_sched.step(v_video[0].float(), video_t, video, return_dict=False)[0]
            audio = audio_sched.step(v_audio[0].float(), audio_t, audio, return_dict=False)[0]
            self._sync()  # per-step latency and progress; one sync per step
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if env.rank == 0:
                log.info("%s step %d/%d %.1f ms", req.request_id, i + 1, req.steps, step_ms[-1])
        return video, audio, step_ms, aborted, t_loop

    def _result(self, req: Request, layout: PackedLayout, video: torch.Tensor,
                audio: torch.Tensor, step_ms: list[float], aborted: Abort,
                times: tuple[float, float, float]) -> RunResult:
        """Rank 0's :class:`RunResult` of a finished loop: the checksum and (with an output
        directory) the latents unless aborted, the phase shares, the padded token count and the
        run's times (``times``: its start, the loop's start, the loop's end)."""
        t_start, t_loop, t_denoised = times
        csum, latent = None, None
        if aborted is Abort.NONE:
            csum = latent_checksum(video, audio)
            if self.output_dir:
                latent = {"video": video.float().cpu(), "audio": audio.float().cpu()}
        phases = self.timer.totals_ms()
        denoise_ms = sum(step_ms)
        attn_ms = sum(phases.values())
        a2a_ms = sum(v for k, v in phases.items() if k.startswith("a2a"))
        world = self.env.world_size
        from dist_attn.integrations.diffusers import ulysses_handle

        handle = ulysses_handle(self.model)  # the bucket the model pads to, as enabled
        bucket = handle.sequence_bucket if handle is not None else 1
        t_end = time.perf_counter()
        return RunResult(
            request_id=req.request_id, request=req.to_json(),
            tokens=TokenCounts(used=layout.used, total=padded_rows(layout.used, world, bucket),
                               text=layout.text, audio=layout.audio, video=layout.video,
                               frames=layout.frames, latent_shape=list(layout.latent_shape)),
            world_size=world, backend=self.backend,
            step_latency_ms=[round(x, 3) for x in step_ms], denoise_ms=round(denoise_ms, 3),
            run_ms=round((t_end - t_start) * 1e3, 3), setup_ms=round((t_loop - t_start) * 1e3, 3),
            finalize_ms=round((t_end - t_denoised) * 1e3, 3),
            phase_ms={k: round(v, 3) for k, v in sorted(phases.items())},
            attention_share=attn_ms / denoise_ms if denoise_ms else 0.0,
            all_to_all_share=a2a_ms / denoise_ms if denoise_ms else 0.0,
            checksum=csum, aborted=aborted, latent=latent)

    def save_output(self, result: RunResult) -> None:
        """Rank 0 only: writes ``result.latent`` (``video`` and ``audio`` rows) to
        ``<output_dir>/<request_id>.safetensors``, sets ``result.output`` to that file's name
        (relative to the output directory) and deletes the served requests' files beyond the
        newest ``jobs.latents_kept``. An OSError here concerns this request alone."""
        if result.latent is None or not self.output_dir:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        name = f"{result.request_id}.safetensors"
        save_output(result.latent, os.path.join(self.output_dir, name),
                    metadata={"request": json.dumps(result.request),
                              "checksum": json.dumps(dataclasses.asdict(result.checksum))})
        # A name, not an absolute path: no server paths in answers.
        result.output = name
        result.latent = None
        # Only the newest jobs.latents_kept outputs stay: one file per request would fill the disk.
        prune_outputs(self.output_dir, keep=self.cfg.jobs.latents_kept)
