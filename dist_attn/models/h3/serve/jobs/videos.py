# SPDX-License-Identifier: Apache-2.0
"""The request schema of ``POST /v1/videos``: what a client may ask of the H3 pipeline and how
it is checked, on rank 0, before the job is stored.

The rules come from the pipeline itself (:class:`VideoRules`: the canvas multiple, the video
VAE's ``17 * n + 5`` frame grid, the 5-15 s duration window at 24 fps, the tokenizer that says
how many text rows a prompt becomes), so a request that passes here is one the pipeline runs;
nothing is rounded or replaced silently. Every error names the field, its value and the rule.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from dist_attn.models.h3.serve.config.fields import steps_rule
from dist_attn.models.h3.serve.jobs.requests import RequestError

__all__ = ["VideoRules", "VideoRequest", "parse_video_request", "FIELDS"]

#: The fields of a request body.
FIELDS = ("prompt", "negative_prompt", "frames", "height", "width", "steps", "guidance", "seed")


@dataclass(kw_only=True, frozen=True)
class VideoRules:
    """What the served pipeline accepts, and its defaults. Built by the runner from the loaded
    components (see :meth:`dist_attn.models.h3.serve.h3.pipeline.H3Pipeline.rules`)."""

    canvas_multiple: int = 32
    """height and width are multiples of this (the VAE's spatial compression x the patch)."""
    spatial_compression: int = 16
    """Pixels per latent along height and width (the video VAE)."""
    patch: tuple[int, int, int] = (1, 2, 2)
    """The transformer's (t, h, w) patch."""
    frames_per_chunk: int = 17
    """The video VAE's clip length: frames are ``frames_per_chunk * n + latents_per_chunk``."""
    latents_per_chunk: int = 5
    fps: int = 24
    """H3's fixed frame rate."""
    min_duration_s: float = 5.0
    max_duration_s: float = 15.0
    audio_channels: int = 2
    """Stereo, packed channel-major: audio rows = latents per channel x channels."""
    audio_latents_per_s: int = 40
    max_pixels: int = 768 * 1344
    """Largest height x width (the canvas the checkpoint was released for)."""
    min_aspect: float = 0.25
    max_aspect: float = 4.0
    default_height: int = 768
    default_width: int = 1344
    default_frames: int = 124
    default_steps: int = 30
    max_steps: int = 100
    max_rows: int = 65536
    """Largest packed sequence (text + audio + video rows): serve.max_tokens."""
    max_prompt_chars: int = 4000
    text_rows: Callable[[str], int] = field(default=lambda prompt: len(prompt.split()),
                                            compare=False, repr=False)
    """How many text rows a prompt becomes (the pipeline's tokenizer, no special tokens)."""

    def frames_ok(self, frames: int) -> str | None:
        """Why ``frames`` is refused, or None."""
        lo = math.ceil(self.min_duration_s * self.fps)
        hi = math.floor(self.max_duration_s * self.fps)
        step, rest = self.frames_per_chunk, self.latents_per_chunk
        valid = [f for f in range(lo, hi + 1) if f % step == rest]
        if frames in valid:
            return None
        if frames % step == rest:
            return (f"gives {frames / self.fps:.2f} s at {self.fps} fps, outside "
                    f"[{self.min_duration_s:g}, {self.max_duration_s:g}] s: one of {valid[0]}, "
                    f"{valid[1]}, ..., {valid[-1]}")
        below = [f for f in valid if f < frames]
        above = [f for f in valid if f > frames]
        near = " or ".join(str(x) for x in (below[-1:] + above[:1]))
        return (f"must be {step} * n + {rest} (the video VAE's chunks) and give "
                f"{self.min_duration_s:g}-{self.max_duration_s:g} s at {self.fps} fps; nearest: "
                f"{near}")

    def rows(self, *, text_rows: int, frames: int, height: int, width: int) -> dict[str, int]:
        """Packed rows of a request: ``{"text", "audio", "video", "total"}``, by the pipeline's
        layout ``[text | audio | video]``."""
        latent_frames = (frames - self.latents_per_chunk) // self.frames_per_chunk \
            * self.latents_per_chunk + 2
        _, ph, pw = self.patch
        per_frame = (height // self.spatial_compression // ph) * (width // self.spatial_compression
                                                                  // pw)
        audio = int(round(frames / self.fps * self.audio_latents_per_s)) * self.audio_channels
        video = latent_frames // self.patch[0] * per_frame
        return {"text": text_rows, "audio": audio, "video": video,
                "total": text_rows + audio + video}


@dataclass(kw_only=True, frozen=True)
class VideoRequest:
    """A validated ``t2va`` request (what the job store keeps and the runner runs)."""

    prompt: str
    frames: int
    """Video frames at 24 fps, of the form 17 * n + 5."""
    height: int
    width: int
    steps: int
    """Denoising steps: transformer forwards (the scheduler's grid has one point more, the
    terminal 0)."""
    seed: int
    """Seed of the request's generator (chosen at random when the client gave none; reported)."""
    rows: int = 0
    """Packed rows (text + audio + video) the request becomes."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "VideoRequest":
        return cls(**data)


def _int_field(payload: dict, name: str, default: int) -> int:
    value = payload.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(400, f"{name}={value!r} must be an integer")
    return value


def _lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in ``text`` (None when there is none). JSON may spell
    one (``"\\ud800"``); the pipeline's tokenizer raised on it and the client got a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def parse_video_request(payload: Any, rules: VideoRules) -> VideoRequest:
    """Validates a decoded JSON body; raises :class:`RequestError` (400, or 413 for a request
    above a size limit) naming the field, its value and the rule. The checks run in a fixed
    order (the body's shape, the prompt, the unsupported inputs, the geometry, steps and seed,
    the packed rows): the first that fails is the one reported."""
    if not isinstance(payload, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - set(FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; valid: {list(FIELDS)}")
    prompt = _checked_prompt(payload.get("prompt"), rules)
    _refuse_guidance_inputs(payload)
    if ("height" in payload) != ("width" in payload):
        raise RequestError(400, "height and width must be given together, or neither")
    height = _int_field(payload, "height", rules.default_height)
    width = _int_field(payload, "width", rules.default_width)
    frames = _int_field(payload, "frames", rules.default_frames)
    steps = _int_field(payload, "steps", rules.default_steps)
    seed = payload.get("seed")
    seed = secrets.randbelow(2**63) if seed is None else _int_field(payload, "seed", 0)
    _check_geometry(rules, frames=frames, height=height, width=width)
    _check_steps_and_seed(rules, steps=steps, seed=seed)
    rows = _checked_rows(rules, prompt, frames=frames, height=height, width=width)
    return VideoRequest(prompt=prompt, frames=frames, height=height, width=width, steps=steps,
                        seed=seed, rows=rows)


def _checked_prompt(prompt: Any, rules: VideoRules) -> str:
    """``prompt`` when it is non-empty Unicode text within ``rules.max_prompt_chars``."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError(400, f"prompt={prompt!r} must be a non-empty string")
    if len(prompt) > rules.max_prompt_chars:
        raise RequestError(413, f"prompt of {len(prompt)} characters exceeds "
                                f"{rules.max_prompt_chars}")
    surrogate = _lone_surrogate(prompt)
    if surrogate is not None:
        code = ord(prompt[surrogate])
        raise RequestError(400, f"prompt={prompt!r} holds a lone surrogate (U+{code:04X} at "
                                f"index {surrogate}): it must be Unicode text (a JSON "
                                "\\uD800-\\uDFFF escape only as half of a pair)")
    return prompt


def _refuse_guidance_inputs(payload: dict) -> None:
    """H3 is guidance-distilled: one forward per step, no unconditional branch, no guidance
    scale (its pipeline has neither input). Accepting other values would ignore them silently."""
    negative = payload.get("negative_prompt")
    if negative not in (None, ""):
        raise RequestError(400, f"negative_prompt={negative!r} is not supported: MiniMax-H3 is "
                                "guidance-distilled (no unconditional pass); omit it")
    guidance = payload.get("guidance")
    if guidance is not None and (isinstance(guidance, bool) or guidance != 1):
        raise RequestError(400, f"guidance={guidance!r} is not supported: MiniMax-H3 is "
                                "guidance-distilled (guidance is in its weights); omit it or "
                                "pass 1")


def _check_geometry(rules: VideoRules, *, frames: int, height: int, width: int) -> None:
    """The canvas (multiple, aspect ratio, pixel count), then the frame count."""
    for name, value in (("height", height), ("width", width)):
        if value <= 0 or value % rules.canvas_multiple:
            raise RequestError(400, f"{name}={value} must be a positive multiple of "
                                    f"{rules.canvas_multiple}")
    if not rules.min_aspect <= width / height <= rules.max_aspect:
        raise RequestError(400, f"width/height={width}/{height} must be within "
                                f"[{rules.min_aspect:g}, {rules.max_aspect:g}]")
    if height * width > rules.max_pixels:
        raise RequestError(413, f"height*width={height * width} exceeds {rules.max_pixels} "
                                "pixels")
    reason = rules.frames_ok(frames)
    if reason:
        raise RequestError(400, f"frames={frames} {reason}")


def _check_steps_and_seed(rules: VideoRules, *, steps: int, seed: int) -> None:
    if steps <= 0:
        raise RequestError(400, f"steps={steps} must be a positive integer")
    rule = steps_rule(steps, rules.max_steps)
    if rule:
        raise RequestError(413, f"steps={steps} {rule}")
    if not 0 <= seed < 2**63:
        raise RequestError(400, f"seed={seed} must be in [0, 2**63)")


def _checked_rows(rules: VideoRules, prompt: str, *, frames: int, height: int,
                  width: int) -> int:
    """The packed rows of the request, within ``rules.max_rows`` (serve.max_tokens)."""
    text = rules.text_rows(prompt)
    if text < 1:
        raise RequestError(400, f"prompt={prompt!r} becomes no text token")
    rows = rules.rows(text_rows=text, frames=frames, height=height, width=width)
    if rows["total"] > rules.max_rows:
        raise RequestError(413, f"the request packs {rows['total']} rows ({rows['text']} text + "
                                f"{rows['audio']} audio + {rows['video']} video), above "
                                f"serve.max_tokens={rules.max_rows}")
    return rows["total"]
