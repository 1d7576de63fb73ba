# SPDX-License-Identifier: Apache-2.0
"""The sections of a serving config, one kw-only dataclass per TOML table (``[tokens]`` is
:class:`dist_attn.models.h3.serve.config.tokens.TokenConfig`, ``[jobs]``
:class:`dist_attn.models.h3.serve.config.jobs.JobsConfig`). Every ``__post_init__`` raises
:class:`ValueError` naming the field, its value and the rule it breaks; rules across sections are
:class:`dist_attn.models.h3.serve.config.deployment.Config`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from dist_attn.models.h3.fp8.linear import LINEAR_PRECISIONS, LinearPrecision
from dist_attn.models.h3.serve.config.compiling import (COMPILED_SEQUENCE_BUCKET,
                                                        SERVED_RECOMPILE_LIMIT, WARMUP_STEPS,
                                                        sequence_bucket_rule, warmup_shapes_rule)
from dist_attn.models.h3.serve.config.fields import (field_error, require_non_negative,
                                                     require_positive)
from dist_attn.models.h3.serve.config.quality import (QualityTier, registered_backend,
                                                      tier_backend_rule, tier_compile_rule,
                                                      tier_name_rule)
from dist_attn.validation import overlap_chunks_rule

__all__ = [
    "H3_ARCHITECTURE",
    "ModelConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "RequestConfig",
    "ServeConfig",
    "registered_backend",
    "COMPILED_SEQUENCE_BUCKET",
    "SERVED_RECOMPILE_LIMIT",
    "WARMUP_STEPS",
    "warmup_shapes_rule",
]

DType = Literal["auto", "bfloat16", "float16", "float32"]


#: The fields of ModelConfig that are arguments of diffusers' MiniMaxH3Transformer3DModel.
H3_ARCHITECTURE = ("num_attention_heads", "attention_head_dim", "hidden_size", "num_layers",
                   "num_refiner_layers", "ffn_dim", "in_channels", "audio_in_channels",
                   "patch_size", "text_dim", "freq_dim", "time_embed_hidden_dim", "time_embed_dim",
                   "rope_freq_dim", "rope_theta", "norm_eps", "qk_norm_eps", "final_norm_eps")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """The served DiT: diffusers' ``MiniMaxH3Transformer3DModel`` with these arguments (the
    defaults are the class's own, i.e. H3's). Weights are replicated; activations are
    sequence-sharded by :func:`dist_attn.integrations.diffusers.enable_ulysses`."""

    name: str = "h3"
    """A label that travels into logs, /health and benchmark results."""
    num_attention_heads: int = 56
    """Attention heads (plain multi-head, no GQA). At least the Ulysses degree; need not divide
    it (the first ``num_heads % W`` ranks take one extra head)."""
    attention_head_dim: int = 128
    """Per-head width. Constrained by the attention backend (``AttentionBackend.head_dims``)."""
    hidden_size: int = 5376
    """Residual stream width (smaller than heads x head_dim in H3: 5376 vs 7168)."""
    num_layers: int = 50
    """Transformer blocks."""
    num_refiner_layers: int = 2
    """Token-refiner blocks over the text rows."""
    ffn_dim: int = 14336
    """Inner width of the SwiGLU feed-forward."""
    in_channels: int = 24
    """Channels of the video latents (one row = ``in_channels * prod(patch_size)`` values)."""
    audio_in_channels: int = 32
    """Channels of the audio latents (one row each)."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(t, h, w) patch of the video latents."""
    text_dim: int = 5120
    """Width of the text conditioning (Qwen3-VL's hidden state)."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding."""
    time_embed_hidden_dim: int = 5376
    """Inner width of the timestep MLP."""
    time_embed_dim: int = 2688
    """Output of the timestep MLP, the input of every AdaLN projection."""
    rope_freq_dim: int = 16
    """Rotary frequencies per (t, h, w) axis; ``2 * 3 * rope_freq_dim`` head channels rotate
    (H3: 96 of 128)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Epsilon of the pre-attention and pre-FFN RMSNorms."""
    qk_norm_eps: float = 1e-5
    """Epsilon of the per-head q/k RMSNorms."""
    final_norm_eps: float = 1e-5
    """Epsilon of the refiner's output norm and of ``norm_out``."""
    weight_seed: int = 0
    """Seed of the class's own random initialisation when no ``--checkpoint`` is given (every
    rank draws the same weights)."""
    linear_precision: LinearPrecision = "bf16"
    """Precision of every block's q/k/v/out projections and FFN linears: "bf16" (the blocks'
    dtype) or "fp8" (e4m3 with per-row activation and per-channel weight scales, float32
    accumulation: torchao's float8 inference through ``torch._scaled_mm``; needs CUDA compute
    capability >= 8.9, bfloat16 blocks and the ``fp8`` extra; refused under quality="lossless").
    The float32 modules, the token refiner, the AdaLN projections and the output heads stay as
    they are (:func:`dist_attn.models.h3.fp8.quantize_linears`)."""
    fp8_fast_accum: bool = False
    """With ``linear_precision = "fp8"``: ``torch._scaled_mm(use_fast_accum=True)``, Hopper's FP8
    accumulator without periodic float32 promotion (faster GEMMs, fewer bits kept over
    K = 5,376-14,336; docs/serving.md gives the measured time and latents error). Never implied
    by "fp8"; true with "bf16" linears is an error."""
    fp8_fused_kernels: bool = True
    """With ``linear_precision = "fp8"`` on CUDA: each block's SwiGLU and its two norm + AdaLN
    steps run fused with their FP8 quantization (``quantize_linears``' defaults, ``fuse_swiglu``
    and ``fuse_adaln`` "auto": the same recipe in fewer passes; docs/serving.md gives the
    measured time and latents). false: diffusers' FFN and block forward around the FP8 GEMMs,
    for comparison or should a fused kernel misbehave on a GPU. No effect with "bf16" linears."""

    def __post_init__(self) -> None:
        if self.linear_precision not in LINEAR_PRECISIONS:
            raise field_error("ModelConfig", "linear_precision", self.linear_precision,
                              f"must be one of {', '.join(map(repr, LINEAR_PRECISIONS))}")
        if not isinstance(self.fp8_fast_accum, bool):
            raise field_error("ModelConfig", "fp8_fast_accum", self.fp8_fast_accum, "must be true or false")
        if not isinstance(self.fp8_fused_kernels, bool):
            raise field_error("ModelConfig", "fp8_fused_kernels", self.fp8_fused_kernels,
                              "must be true or false")
        if self.fp8_fast_accum and self.linear_precision != "fp8":
            raise field_error("ModelConfig", "fp8_fast_accum", self.fp8_fast_accum,
                              f"needs linear_precision='fp8', not {self.linear_precision!r}")
        require_positive(self, "num_attention_heads", "attention_head_dim", "hidden_size",
                         "num_layers", "ffn_dim", "in_channels", "audio_in_channels", "text_dim",
                         "freq_dim", "time_embed_hidden_dim", "time_embed_dim", "rope_freq_dim")
        require_non_negative(self, "num_refiner_layers", "weight_seed")
        patch = self.patch_size
        if (not isinstance(patch, (list, tuple)) or len(patch) != 3
                or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in patch)):
            raise field_error("ModelConfig", "patch_size", patch, "must be three positive integers (t, h, w)")
        object.__setattr__(self, "patch_size", tuple(patch))  # TOML gives a list
        if 6 * self.rope_freq_dim > self.attention_head_dim:
            raise field_error("ModelConfig", "rope_freq_dim", self.rope_freq_dim,
                              f"rotates 2 * 3 * {self.rope_freq_dim} = {6 * self.rope_freq_dim} "
                              f"channels, more than attention_head_dim={self.attention_head_dim}")
        if self.freq_dim % 2:
            raise field_error("ModelConfig", "freq_dim", self.freq_dim, "must be even (sin/cos halves)")
        for name in ("rope_theta", "norm_eps", "qk_norm_eps", "final_norm_eps"):
            if not getattr(self, name) > 0:
                raise field_error("ModelConfig", name, getattr(self, name), "must be > 0")

    @property
    def num_heads(self) -> int:
        """H: ``num_attention_heads``."""
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """D: ``attention_head_dim``."""
        return self.attention_head_dim

    @property
    def inner_dim(self) -> int:
        """num_heads * head_dim: width of q, k, v and of the attention output."""
        return self.num_attention_heads * self.attention_head_dim

    def diffusers_config(self) -> dict[str, Any]:
        """The keyword arguments of ``MiniMaxH3Transformer3DModel(...)``."""
        return {name: getattr(self, name) for name in H3_ARCHITECTURE}


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """Parallel degrees. Ulysses and ring are implemented; tensor parallel exists so that a
    deployment can state it and the quality tier can check it."""

    ulysses_degree: int = 0
    """Ulysses (head-scatter) degree; 0 means "world size / (ring_degree * tensor_parallel)"."""
    ring_degree: int = 1
    """Ring-attention degree R: the ranks form a ("ring", "ulysses") mesh, Ulysses over
    consecutive ranks (one host), the ring across them (hosts). R > 1 needs a backend that
    returns a log-sum-exp."""
    tensor_parallel: int = 1
    """Tensor-parallel degree. dist_attn implements 1 only."""
    overlap_chunks: int = 1
    """C >= 1: every attention call splits its heads into C chunks and pipelines each chunk's
    kernel against the next chunk's all-to-alls (``enable_ulysses(overlap_chunks=C)``). 1 is one
    all-to-all each way; C > 1 pays C launches of everything for hiding all but one chunk's
    communication (docs/library.md). Same results for every C."""
    shard_weights: bool | Literal["auto"] = "auto"
    """Shard the transformer's and the text encoder's weights over every rank with FSDP2 (one
    unit per block, each gathered just before it runs and freed after, the next one's gather
    overlapping it): each rank keeps 1/W of them, built and loaded block by block so that no
    rank ever holds a whole replica. Same outputs bit for bit; costs one all-gather of each block
    per forward (docs/serving.md). false: every rank holds the transformer whole and rank 0 the
    text encoder. "auto": sharded when the memory pre-flight estimates that a replica does not
    fit with ``memory.headroom_fraction`` to spare (logged, with the estimate); not sharded
    where the pre-flight does not run (a CPU without ``memory.device_gb``) or on one rank."""

    def __post_init__(self) -> None:
        if not isinstance(self.shard_weights, bool) and self.shard_weights != "auto":
            raise field_error("ParallelConfig", "shard_weights", self.shard_weights,
                              'must be true, false or "auto"')
        require_non_negative(self, "ulysses_degree")
        require_positive(self, "ring_degree", "tensor_parallel")
        rule = overlap_chunks_rule(self.overlap_chunks)
        if rule:
            raise field_error("ParallelConfig", "overlap_chunks", self.overlap_chunks, rule)

    def resolved_ulysses(self, world_size: int) -> int:
        """The Ulysses degree for ``world_size`` ranks (0 -> world_size / (ring * tensor_parallel))."""
        return self.ulysses_degree or max(1, world_size // (self.ring_degree * self.tensor_parallel))


@dataclass(kw_only=True, frozen=True)
class RuntimeConfig:
    """What runs the attention and how ranks wait for each other."""

    backend: str = "auto"
    """Attention backend name ("auto", "sage", "sdpa", or one registered later)."""
    dtype: DType = "auto"
    """Activation/weight dtype; "auto" is bfloat16 on CUDA and float32 on CPU."""
    quality: QualityTier | None = None
    """Quality tier checked at launch; None admits every backend and topology."""
    pg_timeout_s: float = 60.0
    """Process-group timeout: a rank whose peers died or hang exits non-zero after at most this
    long."""
    heartbeat_s: float = 2.0
    """Idle rank 0 exchanges a heartbeat with every rank this often, so waiting ranks never reach
    the timeout and rank 0 knows they answer."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile every H3 transformer block, fullgraph (attention stays one opaque op; FP8
    linears are traced as torchao tensor subclasses; the refiner blocks, whose rows are the
    prompt's tokens, stay eager). ``"auto"``: compiled on CUDA, eager elsewhere. Compiled, the
    real block at h3-ref runs 1.13x as fast as eager with bf16 linears (``benchmarks/h3_fp8.py``;
    docs/serving.md has the figures), and FP8 linears pay only compiled (eager, their per-row
    activation quantizer runs as separate kernels). On the CPU inductor's C++ build costs ~50 s a
    shape on a 2-core machine for a path that serves tests; ``true`` compiles there too.
    ``quality="lossless"`` stays eager (its bf16 path bit for bit) and refuses ``true``."""
    warmup_shapes: tuple[tuple[int, int, int], ...] = ()
    """Request geometries ``(frames, height, width)`` that every rank runs for two denoise steps
    (the first step's shapes and every later step's) at launch, before the HTTP server answers
    /health: compiles the blocks for those shapes and
    JITs the attention and GEMM kernels, so no user request pays for it. Empty: none."""
    sequence_bucket: int | Literal["auto"] = "auto"
    """Rows the packed sequence is padded to a multiple of (at its end; padding rows are never
    attended and are dropped from the output), so that compiled blocks see one shape per bucket
    and compile once for every prompt length in it; the true length reaches the compiled
    attention as a tensor. ``"auto"``: 512 when the blocks are compiled, else 1 (a multiple of
    the world size only). Under ``quality="lossless"`` only 1 or ``"auto"``: padding changes
    each rank's row count, which may change how the GEMMs round."""
    warmup_prompt_tokens: int = 512
    """With compiled blocks, the warm-up covers prompts of 1 to this many tokens: it runs every
    sequence bucket a ``warmup_shapes`` geometry reaches with them (one or two at the default
    bucket), and the stand-in's ``tokens.text_tokens``. A longer prompt's first job may compile.
    The config refuses a warm-up that could compile more than 16 padded lengths (over all
    geometries): half of what the raised recompile limit holds, the rest left to later jobs."""
    health_timeout_s: float = 10.0
    """/health reports not-ready when rank 0 has not heard from every rank for this long. Rank 0
    hears from all ranks at every heartbeat and after every denoise step, so this must exceed one
    step."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise field_error("RuntimeConfig", "backend", self.backend, "must be a non-empty string")
        if self.dtype not in get_args(DType):
            raise field_error("RuntimeConfig", "dtype", self.dtype,
                        f"must be one of {', '.join(map(repr, get_args(DType)))}")
        if not isinstance(self.compile, bool) and self.compile != "auto":
            raise field_error("RuntimeConfig", "compile", self.compile,
                              "must be true, false or \"auto\"")
        rule = warmup_shapes_rule(self.warmup_shapes)
        if rule:
            raise field_error("RuntimeConfig", "warmup_shapes", self.warmup_shapes, rule)
        object.__setattr__(self, "warmup_shapes", tuple(tuple(s) for s in self.warmup_shapes))

        rule = tier_name_rule(self.quality)
        if rule:
            raise field_error("RuntimeConfig", "quality", self.quality, rule)
        rule = tier_backend_rule(self.quality, self.backend)
        if rule:
            raise field_error("RuntimeConfig", "backend", self.backend, rule)
        rule = tier_compile_rule(self.quality, self.compile)
        if rule:
            raise field_error("RuntimeConfig", "compile", self.compile, rule)
        rule = sequence_bucket_rule(self.sequence_bucket, self.quality)
        if rule:
            raise field_error("RuntimeConfig", "sequence_bucket", self.sequence_bucket, rule)
        require_positive(self, "warmup_prompt_tokens")
        if not self.pg_timeout_s > 0:
            raise field_error("RuntimeConfig", "pg_timeout_s", self.pg_timeout_s, "must be > 0")
        if not 0 < self.heartbeat_s < self.pg_timeout_s / 2:
            raise field_error("RuntimeConfig", "heartbeat_s", self.heartbeat_s,
                        f"must be > 0 and below pg_timeout_s/2={self.pg_timeout_s / 2} so idle "
                        "ranks are woken before their broadcast times out")
        if not self.health_timeout_s > self.heartbeat_s:
            raise field_error("RuntimeConfig", "health_timeout_s", self.health_timeout_s,
                        f"must exceed heartbeat_s={self.heartbeat_s} (a healthy idle server "
                        "hears from its ranks once per heartbeat)")

    def compiled(self, device_type: str) -> bool:
        """Whether the blocks are compiled on a device of ``device_type`` (``"cuda"``, ...)."""
        if self.compile == "auto":  # eager under "lossless": its bf16 path, bit for bit
            return device_type == "cuda" and self.quality != "lossless"
        return bool(self.compile)

    def bucket(self, device_type: str) -> int:
        """``sequence_bucket`` resolved on a device of ``device_type``."""
        if self.sequence_bucket == "auto":
            return COMPILED_SEQUENCE_BUCKET if self.compiled(device_type) else 1
        return self.sequence_bucket


@dataclass(kw_only=True, frozen=True)
class RequestConfig:
    """The default request: a video geometry, as H3's pipeline takes it."""

    frames: int = 124
    """Video frames (rounded up to the next 17 n + 5; H3's default 124)."""
    height: int = 768
    """Video height in pixels; a multiple of 32 (H3's canvas: 768 x 1344)."""
    width: int = 1344
    """Video width in pixels; a multiple of 32."""
    steps: int = 50
    """Denoising steps: forward passes of the transformer (the scheduler's grid has one more
    point, the terminal sigma 0)."""
    seed: int = 0
    """Seed of the initial noise and of the stand-in text embedding."""

    def __post_init__(self) -> None:
        require_positive(self, "frames", "height", "width", "steps")
        require_non_negative(self, "seed")


#: torchrun's agent sends SIGKILL this long after forwarding SIGTERM to its ranks.
_TORCHRUN_KILL_GRACE_S = 30.0


@dataclass(kw_only=True, frozen=True)
class ServeConfig:
    """HTTP server on rank 0 and the limits it enforces before anything is broadcast."""

    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 8000
    """Bind port (0 picks a free one; the bound port is logged)."""
    max_tokens: int = 65536
    """Largest accepted packed sequence (rows, before the padding to ``runtime.sequence_bucket``,
    which adds up to ``W * ceil(sequence_bucket / W) - 1``); larger requests get 413."""
    max_steps: int = 100
    """Largest accepted step count; larger requests get 413."""
    max_body_bytes: int = 65536
    """Largest accepted request body; larger bodies get 413."""
    max_header_bytes: int = 16384
    """Largest accepted request head (request line + headers); larger heads get 400."""
    max_json_depth: int = 4
    """Deepest accepted JSON nesting (a request is one flat object); deeper bodies get 400
    before they are parsed (30,000 levels crashed a recursive parser)."""
    max_int_digits: int = 20
    """Longest accepted integer literal (2**63 has 19 digits); longer ones get 400 before they
    are converted (a 5000-digit literal raised inside the parser)."""
    queue_size: int = 64
    """Requests waiting beyond this get 429 with Retry-After."""
    request_timeout_s: float = 3600.0
    """Default and largest deadline of a request, receipt to result: past it the request is
    dropped from the queue or aborted between denoise steps, and answered 504."""
    idle_timeout_s: float = 5.0
    """A connection that has not sent a complete request head, or a complete body, within this
    many seconds is closed (idle keep-alive connections too)."""
    backlog: int = 2048
    """Listen backlog: connections the kernel holds before the server accepts them (a burst of
    a few hundred must not be reset)."""
    drain_timeout_s: float = 20.0
    """On SIGTERM/SIGINT the running request gets this long to finish before it is aborted;
    below torchrun's 30 s between its SIGTERM and SIGKILL, so every rank exits on its own."""

    def __post_init__(self) -> None:
        require_non_negative(self, "port")
        if self.port > 65535:
            raise field_error("ServeConfig", "port", self.port, "must be <= 65535")
        require_positive(self, "max_tokens", "max_steps", "max_body_bytes", "max_header_bytes",
                  "max_json_depth", "max_int_digits", "queue_size", "backlog")
        for name in ("request_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise field_error("ServeConfig", name, getattr(self, name), "must be > 0")
        if not 0 < self.drain_timeout_s <= _TORCHRUN_KILL_GRACE_S - 5:
            raise field_error("ServeConfig", "drain_timeout_s", self.drain_timeout_s,
                        f"must be > 0 and at most {_TORCHRUN_KILL_GRACE_S - 5} s (torchrun kills "
                        f"ranks {_TORCHRUN_KILL_GRACE_S} s after its SIGTERM; 5 s are left for "
                        "the shutdown itself)")
