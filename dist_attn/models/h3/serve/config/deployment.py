# SPDX-License-Identifier: Apache-2.0
"""The whole deployment (:class:`Config`): the sections together, the rules across them, and the
rules that need the world size (:meth:`Config.check_world`, called by the launcher on every rank
before the process group is used)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dist_attn.plan import heads_per_rank
from dist_attn.models.h3.serve.config.compiling import warmup_bound_rule
from dist_attn.models.h3.serve.config.fields import field_error, steps_rule
from dist_attn.models.h3.serve.config.jobs import JobsConfig
from dist_attn.models.h3.serve.config.memory import DecodeConfig, MemoryConfig
from dist_attn.models.h3.serve.config.quality import tier_linear_rule
from dist_attn.models.h3.serve.config.sections import (WARMUP_STEPS, ModelConfig, ParallelConfig,
                                                       RequestConfig, RuntimeConfig, ServeConfig,
                                                       registered_backend)
from dist_attn.models.h3.serve.config.tokens import PackedLayout, TokenConfig, request_layout

__all__ = ["Config"]


@dataclass(kw_only=True, frozen=True)
class Config:
    """The whole deployment. Cross-section rules are checked here; world-size rules in
    :meth:`check_world`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tokens: TokenConfig = field(default_factory=TokenConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    request: RequestConfig = field(default_factory=RequestConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        self.check_backend(self.runtime.backend)
        precision = self.model.linear_precision
        rule = tier_linear_rule(self.runtime.quality, precision)
        if rule:
            raise field_error("ModelConfig", "linear_precision", precision, rule)
        if precision == "fp8" and self.runtime.dtype in ("float16", "float32"):
            raise field_error("ModelConfig", "linear_precision", precision,
                              f"needs bfloat16 blocks, not runtime.dtype={self.runtime.dtype!r} "
                              "(torchao's per-row FP8 quantizes bf16 weights; use 'auto' or "
                              "'bfloat16')")
        self._check_warmup_shapes()
        if self.parallel.shard_weights == "auto" and self.memory.preflight is False:
            raise field_error("ParallelConfig", "shard_weights", "auto",
                              "decides from the memory pre-flight, which memory.preflight=false "
                              "turns off: set shard_weights to true or false")
        r = self.request
        try:
            rows = self.layout(frames=r.frames, height=r.height, width=r.width)
        except ValueError as e:
            raise ValueError(f"the default request ([request]) is invalid: {e}") from None
        if rows.used > self.serve.max_tokens:
            raise field_error("RequestConfig", "frames", r.frames,
                              f"gives {rows.used} rows, above serve.max_tokens={self.serve.max_tokens}")
        # The server fills a request's missing fields from [request]: a default it refuses
        # would pass --check-only and then answer 413 to every request that leaves steps out.
        rule = steps_rule(r.steps, self.serve.max_steps)
        if rule:
            raise field_error("RequestConfig", "steps", r.steps, rule)

    def rows_rule(self, layout: PackedLayout) -> str | None:
        """The broken rule if a request of ``layout`` has more rows than ``serve.max_tokens``
        (the one owner: requests, warm-up shapes and the default request all ask here)."""
        if layout.used > self.serve.max_tokens:
            return (f"request has {layout.used} rows ({layout.text} text, {layout.audio} audio, "
                    f"{layout.video} video), above serve.max_tokens={self.serve.max_tokens}")
        return None

    def _check_warmup_shapes(self) -> None:
        """Each ``runtime.warmup_shapes`` geometry must be a valid request (H3's frame and size
        rules, ``serve.max_tokens``, and the warm-up's ``WARMUP_STEPS`` within
        ``serve.max_steps``): a ValueError names the entry. Where the blocks may compile, the
        warm-up's padded lengths must fit :func:`warmup_bound_rule`."""
        rule = steps_rule(WARMUP_STEPS, self.serve.max_steps)
        if self.runtime.warmup_shapes and rule:
            raise field_error("RuntimeConfig", "warmup_shapes", [list(s) for s in self.runtime.warmup_shapes],
                              f"are warmed for {WARMUP_STEPS} steps each, which {rule}")
        for i, (frames, height, width) in enumerate(self.runtime.warmup_shapes):
            try:
                rule = self.rows_rule(self.layout(frames=frames, height=height, width=width))
            except ValueError as e:
                rule = str(e)
            if rule:
                raise ValueError(f"runtime.warmup_shapes[{i}]={[frames, height, width]!r} "
                                 f"is not a valid request: {rule}")
        rt = self.runtime
        rule = warmup_bound_rule(rt.warmup_shapes, rt.warmup_prompt_tokens, rt.sequence_bucket,
                                 text_tokens=self.tokens.text_tokens,
                                 may_compile=rt.compile is not False and rt.quality != "lossless")
        if rule:
            raise field_error("RuntimeConfig", "warmup_prompt_tokens", rt.warmup_prompt_tokens, rule)

    def layout(self, *, frames: int, height: int, width: int) -> PackedLayout:
        """The packed rows of a ``frames`` x ``height`` x ``width`` request (H3's rules)."""
        return request_layout(self.tokens, self.model.patch_size, frames=frames, height=height,
                              width=width)

    def check_backend(self, backend: str) -> None:
        """Raises if ``backend`` (a name, possibly resolved from "auto") cannot run head_dim."""
        registered = registered_backend(backend)
        allowed = registered.head_dims if registered is not None else None
        if allowed is not None and self.model.head_dim not in allowed:
            raise field_error("ModelConfig", "attention_head_dim", self.model.head_dim,
                        f"is not supported by backend {backend!r} (accepts head_dim in "
                        f"{list(allowed)})")

    def check_world(self, world_size: int) -> None:
        """Raises :class:`ValueError` if this config cannot run on ``world_size`` ranks.

        Rules: ulysses * ring * tensor_parallel == world size; the core's head split accepts
        num_heads on the Ulysses degree (at least one head per rank; uneven splits are fine).
        Any packed length works: the attention pads it to a multiple of the world size.
        """
        p = self.parallel
        ulysses = p.resolved_ulysses(world_size)
        if ulysses * p.ring_degree * p.tensor_parallel != world_size:
            raise field_error("ParallelConfig", "ulysses_degree", ulysses,
                        f"times ring_degree={p.ring_degree} times tensor_parallel="
                        f"{p.tensor_parallel} must equal the world size {world_size}")
        heads = self.model.num_heads
        if heads < ulysses:  # heads_per_rank's rule, with the fix in this config's terms
            most = heads * p.ring_degree * p.tensor_parallel
            raise field_error("ModelConfig", "num_attention_heads", heads,
                              f"cannot be split over the Ulysses degree {ulysses}: every rank needs "
                              f"at least one head; launch at most {most} ranks (--nproc-per-node), "
                              "or raise parallel.ring_degree so that the Ulysses degree (world "
                              f"size / ring_degree) is at most {heads}")
        heads_per_rank(heads, ulysses)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (for logs and benchmark result files)."""
        return dataclasses.asdict(self)

