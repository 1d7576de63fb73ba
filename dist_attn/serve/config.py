"""Serving configuration: kw-only dataclasses that validate themselves, loaded from TOML.

A config file has one table per dataclass::

    [model]     -> ModelConfig     (the DiT's shape)
    [tokens]    -> TokenConfig     (how a request becomes packed rows)
    [parallel]  -> ParallelConfig  (Ulysses / ring / tensor-parallel degrees)
    [runtime]   -> RuntimeConfig   (backend, dtype, quality tier, timeouts)
    [request]   -> RequestConfig   (the default request: ``--once`` and the benchmark)
    [serve]     -> ServeConfig     (HTTP server and request limits)

Every ``__post_init__`` raises :class:`ValueError` naming the field, its value and the rule it
breaks. Rules that need the world size (heads vs Ulysses degree, packed alignment vs world size)
are checked by :meth:`Config.check_world`, which the launcher calls on every rank before the
process group is used.

:data:`DEFAULT_CONFIG_TOML` is the embedded default (identical to ``configs/tiny.toml``) so that
``torchrun --nproc-per-node 4 launch/serve.py`` works with no arguments.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = [
    "ModelConfig",
    "TokenConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "RequestConfig",
    "ServeConfig",
    "Config",
    "PackedLayout",
    "DEFAULT_CONFIG_TOML",
    "QUALITY_TIERS",
    "load_config",
    "parse_config",
    "apply_overrides",
    "request_layout",
]

#: Valid ``--quality`` values. ``None`` (flag absent) means no tier constraint.
QualityTier = Literal["lossless", "high"]
QUALITY_TIERS: tuple[str, ...] = get_args(QualityTier)

DType = Literal["auto", "bfloat16", "float16", "float32"]

#: Head dims each attention backend accepts. sageattention 1.0.6 accepts 64/96/128 for its dense
#: kernel (the (0, used, total) bridge makes one dense call), see shared/h3.md. Backends not listed
#: accept any head_dim.


def _fail(cls: str, name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{cls}.{name}={value!r} {rule}")


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _fail(type(obj).__name__, name, value, "must be a positive integer")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _fail(type(obj).__name__, name, value, "must be a non-negative integer")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Shape of the DiT. Weights are replicated; activations are sequence-sharded."""

    name: str = "tiny"
    """A label that travels into logs, /health and benchmark results."""
    num_layers: int = 2
    """Number of DiT blocks."""
    hidden_size: int = 256
    """Residual stream width."""
    num_heads: int = 4
    """Attention heads (plain multi-head, no GQA). Must divide by the Ulysses degree."""
    head_dim: int = 64
    """Per-head width. Constrained by the attention backend (``AttentionBackend.head_dims``)."""
    ffn_size: int = 512
    """Hidden width of the MLP."""
    rope_dims: int = 48
    """RoPE rotates the first ``rope_dims`` of each head's dims (H3: 96 of 128). Even, <= head_dim."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    latent_channels: int = 16
    """Channels of one packed latent row (the denoised state), in and out of the DiT."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding."""
    norm_eps: float = 1e-6
    """Epsilon of the LayerNorms and of the q/k RMSNorms."""
    weight_seed: int = 0
    """Seed of the random weights used when no ``--weights`` file is given."""

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "hidden_size", "num_heads", "head_dim", "ffn_size",
                  "latent_channels", "freq_dim")
        _non_negative(self, "rope_dims", "weight_seed")
        if self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise _fail("ModelConfig", "rope_dims", self.rope_dims,
                        f"must be even and at most head_dim={self.head_dim} (RoPE rotates pairs)")
        if self.freq_dim % 2:
            raise _fail("ModelConfig", "freq_dim", self.freq_dim, "must be even (sin/cos halves)")
        if not self.rope_theta > 0:
            raise _fail("ModelConfig", "rope_theta", self.rope_theta, "must be > 0")
        if not self.norm_eps > 0:
            raise _fail("ModelConfig", "norm_eps", self.norm_eps, "must be > 0")

    @property
    def inner_dim(self) -> int:
        """num_heads * head_dim: width of q, k, v and of the attention output."""
        return self.num_heads * self.head_dim


@dataclass(kw_only=True, frozen=True)
class TokenConfig:
    """How a request (frames x height x width, or a raw token count) becomes packed rows.

    latent frames = (frames - 1) // temporal_compression + 1 + extra_latent_frames;
    latent height/width = height/width // spatial_compression; used rows = latent video rows +
    text_tokens + audio_tokens; total rows = used rounded up to ``alignment``.
    """

    spatial_compression: int = 32
    """Pixels per latent row along height and width (VAE downsampling x patch size)."""
    temporal_compression: int = 4
    """Video frames per latent frame (the first frame gets its own latent frame)."""
    extra_latent_frames: int = 0
    """Conditioning latent frames added to every request (H3: 6, so 124 frames -> 37)."""
    text_tokens: int = 64
    """Text-encoder tokens packed after the video rows."""
    audio_tokens: int = 20
    """Audio tokens packed after the text rows."""
    alignment: int = 64
    """The packed length is padded at the end to a multiple of this. Must divide by world size."""

    def __post_init__(self) -> None:
        _positive(self, "spatial_compression", "temporal_compression", "alignment")
        _non_negative(self, "extra_latent_frames", "text_tokens", "audio_tokens")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """Parallel degrees. Only Ulysses is implemented; ring and tensor parallel exist so that a
    deployment can state them and the quality tier can check them."""

    ulysses_degree: int = 0
    """Ulysses (head-scatter) degree; 0 means "the world size"."""
    ring_degree: int = 1
    """Ring-attention degree. dist_attn implements 1 only."""
    tensor_parallel: int = 1
    """Tensor-parallel degree. dist_attn implements 1 only."""

    def __post_init__(self) -> None:
        _non_negative(self, "ulysses_degree")
        _positive(self, "ring_degree", "tensor_parallel")

    def resolved_ulysses(self, world_size: int) -> int:
        """The Ulysses degree for ``world_size`` ranks (0 -> world_size)."""
        return self.ulysses_degree or world_size


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
    """Process-group timeout: a rank whose peers died exits non-zero after at most this long."""
    heartbeat_s: float = 2.0
    """Idle rank 0 broadcasts a heartbeat this often, so waiting ranks never reach the timeout."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise _fail("RuntimeConfig", "backend", self.backend, "must be a non-empty string")
        if self.dtype not in get_args(DType):
            raise _fail("RuntimeConfig", "dtype", self.dtype,
                        f"must be one of {', '.join(map(repr, get_args(DType)))}")
        if self.quality is not None and self.quality not in QUALITY_TIERS:
            raise _fail("RuntimeConfig", "quality", self.quality,
                        "is not a quality tier; valid values: absent (no constraint), "
                        + ", ".join(map(repr, QUALITY_TIERS)))
        if self.quality == "lossless" and _is_8bit_name(self.backend):
            raise _fail("RuntimeConfig", "backend", self.backend,
                        "is an 8-bit backend, not allowed under quality='lossless' "
                        "(exact bf16 kernels only; use 'sdpa' or 'auto')")
        if not self.pg_timeout_s > 0:
            raise _fail("RuntimeConfig", "pg_timeout_s", self.pg_timeout_s, "must be > 0")
        if not 0 < self.heartbeat_s < self.pg_timeout_s / 2:
            raise _fail("RuntimeConfig", "heartbeat_s", self.heartbeat_s,
                        f"must be > 0 and below pg_timeout_s/2={self.pg_timeout_s / 2} so idle "
                        "ranks are woken before their broadcast times out")


def _is_8bit_name(name: str) -> bool:
    """Whether a backend name denotes an 8-bit (quantized) kernel (the registry's ``exact`` flag)."""
    from dist_attn.serve.quality import is_8bit_backend

    return is_8bit_backend(name, _registered(name))


def _registered(name: str):
    """The core's backend object called ``name``, or None when no such backend is registered."""
    from dist_attn import available_backends, get_backend

    return get_backend(name) if name in available_backends() and name != "auto" else None


@dataclass(kw_only=True, frozen=True)
class RequestConfig:
    """The default request. Either a video geometry (frames, height, width) or ``num_tokens``."""

    frames: int = 9
    """Video frames."""
    height: int = 256
    """Video height in pixels; a multiple of TokenConfig.spatial_compression."""
    width: int = 256
    """Video width in pixels; a multiple of TokenConfig.spatial_compression."""
    num_tokens: int = 0
    """If > 0, the request is this many used rows and the geometry is ignored."""
    steps: int = 4
    """Denoising steps."""
    seed: int = 0
    """Seed of the initial noise."""

    def __post_init__(self) -> None:
        _positive(self, "frames", "height", "width", "steps")
        _non_negative(self, "num_tokens", "seed")


@dataclass(kw_only=True, frozen=True)
class ServeConfig:
    """HTTP server on rank 0 and the limits it enforces before anything is broadcast."""

    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 8000
    """Bind port (0 picks a free one; the bound port is logged)."""
    max_tokens: int = 65536
    """Largest accepted used-row count; larger requests get 413."""
    max_steps: int = 100
    """Largest accepted step count; larger requests get 413."""
    max_body_bytes: int = 65536
    """Largest accepted request body; larger bodies get 413."""
    queue_size: int = 64
    """Requests waiting beyond this get 503."""
    request_timeout_s: float = 3600.0
    """How long an HTTP handler waits for its result before answering 504."""

    def __post_init__(self) -> None:
        _non_negative(self, "port")
        if self.port > 65535:
            raise _fail("ServeConfig", "port", self.port, "must be <= 65535")
        _positive(self, "max_tokens", "max_steps", "max_body_bytes", "queue_size")
        if not self.request_timeout_s > 0:
            raise _fail("ServeConfig", "request_timeout_s", self.request_timeout_s, "must be > 0")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "tokens": TokenConfig,
    "parallel": ParallelConfig,
    "runtime": RuntimeConfig,
    "request": RequestConfig,
    "serve": ServeConfig,
}


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

    def __post_init__(self) -> None:
        self.check_backend(self.runtime.backend)
        rows = request_layout(self, frames=self.request.frames, height=self.request.height,
                              width=self.request.width, num_tokens=self.request.num_tokens)
        if rows.used > self.serve.max_tokens:
            raise _fail("RequestConfig", "num_tokens" if self.request.num_tokens else "frames",
                        rows.used, f"gives {rows.used} rows, above serve.max_tokens="
                        f"{self.serve.max_tokens}")

    def check_backend(self, backend: str) -> None:
        """Raises if ``backend`` (a name, possibly resolved from "auto") cannot run head_dim."""
        registered = _registered(backend)
        allowed = registered.head_dims if registered is not None else None
        if allowed is not None and self.model.head_dim not in allowed:
            raise _fail("ModelConfig", "head_dim", self.model.head_dim,
                        f"is not supported by backend {backend!r} (accepts head_dim in "
                        f"{list(allowed)})")

    def check_world(self, world_size: int) -> None:
        """Raises :class:`ValueError` if this config cannot run on ``world_size`` ranks.

        Rules: ulysses * ring * tensor_parallel == world size; num_heads divisible by the Ulysses
        degree (each rank owns num_heads / W whole heads); alignment divisible by the world size
        (so every packed length, a multiple of alignment, splits into equal contiguous shards).
        """
        p = self.parallel
        ulysses = p.resolved_ulysses(world_size)
        if ulysses * p.ring_degree * p.tensor_parallel != world_size:
            raise _fail("ParallelConfig", "ulysses_degree", ulysses,
                        f"times ring_degree={p.ring_degree} times tensor_parallel="
                        f"{p.tensor_parallel} must equal the world size {world_size}")
        if self.model.num_heads % ulysses:
            raise _fail("ModelConfig", "num_heads", self.model.num_heads,
                        f"is not divisible by the Ulysses degree {ulysses} (each rank must own "
                        "whole heads)")
        if self.tokens.alignment % world_size:
            raise _fail("TokenConfig", "alignment", self.tokens.alignment,
                        f"is not divisible by the world size {world_size} (the packed length, a "
                        "multiple of alignment, must split into equal per-rank shards)")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (for logs and benchmark result files)."""
        return dataclasses.asdict(self)


@dataclass(kw_only=True, frozen=True)
class PackedLayout:
    """Packed rows of one request: rows [0, used) are real, [used, total) padding."""

    used: int
    """Real rows (video + text + audio)."""
    total: int
    """used rounded up to the alignment."""
    latent_shape: tuple[int, int, int] | None = None
    """(latent frames, latent height, latent width), or None for a num_tokens request."""

    def cu_seqlens(self) -> list[int]:
        """Global bounds (0, used, total) when padded, else (0, used): one document per request."""
        return [0, self.used, self.total] if self.total > self.used else [0, self.used]


def request_layout(cfg: Config, *, frames: int, height: int, width: int,
                   num_tokens: int = 0) -> PackedLayout:
    """Packed layout of a request; raises ValueError naming the offending request field."""
    tok = cfg.tokens
    if num_tokens:
        if num_tokens < 0:
            raise _fail("request", "num_tokens", num_tokens, "must be a positive integer")
        used, shape = num_tokens, None
    else:
        for name, value in (("height", height), ("width", width)):
            if value % tok.spatial_compression:
                raise _fail("request", name, value, "must be a multiple of "
                            f"tokens.spatial_compression={tok.spatial_compression}")
        shape = ((frames - 1) // tok.temporal_compression + 1 + tok.extra_latent_frames,
                 height // tok.spatial_compression, width // tok.spatial_compression)
        used = math.prod(shape) + tok.text_tokens + tok.audio_tokens
    total = -(-used // tok.alignment) * tok.alignment
    return PackedLayout(used=used, total=total, latent_shape=shape)


DEFAULT_CONFIG_TOML = """\
# tiny: the CPU default. 2 layers, 4 heads of 64, ~300 tokens; runs on 1, 2 or 4 gloo ranks.
[model]
name = "tiny"
num_layers = 2
hidden_size = 256
num_heads = 4
head_dim = 64
ffn_size = 512
rope_dims = 48          # 3/4 of the head dims, as H3 rotates 96 of 128
rope_theta = 10000.0
latent_channels = 16
freq_dim = 256
norm_eps = 1e-6
weight_seed = 0

[tokens]
spatial_compression = 32
temporal_compression = 4
extra_latent_frames = 0
text_tokens = 64
audio_tokens = 20
alignment = 64

[parallel]
ulysses_degree = 0      # 0 = the world size
ring_degree = 1
tensor_parallel = 1

[runtime]
backend = "auto"
dtype = "auto"
pg_timeout_s = 30.0
heartbeat_s = 1.0

[request]
# 9 frames at 256x256 -> latent 3x8x8 = 192 rows + 64 text + 20 audio = 276 used, 320 packed.
frames = 9
height = 256
width = 256
num_tokens = 0
steps = 4
seed = 0

[serve]
host = "127.0.0.1"
port = 8000
max_tokens = 16384
max_steps = 50
max_body_bytes = 65536
queue_size = 64
request_timeout_s = 600.0
"""


def parse_config(data: dict[str, Any], *, source: str = "<dict>") -> Config:
    """Builds a :class:`Config` from a nested dict (as ``tomllib`` returns); unknown sections and
    fields are errors that name them."""
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise ValueError(f"{source}: unknown config section(s) {sorted(unknown)}; "
                         f"valid: {sorted(_SECTIONS)}")
    sections = {}
    for name, cls in _SECTIONS.items():
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"{source}: [{name}] must be a table, got {table!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        bad = set(table) - names
        if bad:
            raise ValueError(f"{source}: unknown field(s) {sorted(bad)} in [{name}]; "
                             f"valid: {sorted(names)}")
        sections[name] = cls(**table)
    return Config(**sections)


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Loads a TOML config file; ``None`` loads :data:`DEFAULT_CONFIG_TOML`."""
    if path is None:
        return parse_config(tomllib.loads(DEFAULT_CONFIG_TOML), source="<embedded tiny>")
    with open(path, "rb") as f:
        return parse_config(tomllib.load(f), source=str(path))


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Returns a new config with ``{"section.field": value}`` replaced, re-validating everything.

    A value of ``None`` leaves the field unchanged (an argparse flag that was not given), except
    for ``runtime.quality`` where the launcher passes only given values.
    """
    data = cfg.to_dict()
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section not in _SECTIONS or name not in {f.name for f in
                                                    dataclasses.fields(_SECTIONS[section])}:
            raise ValueError(f"override {key!r}: no such config field (use section.field, "
                             f"sections {sorted(_SECTIONS)})")
        data[section][name] = value
    return parse_config(data, source="<overrides>")
