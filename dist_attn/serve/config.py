"""Serving configuration: kw-only dataclasses that validate themselves, loaded from TOML.

A config file has one table per dataclass::

    [model]     -> ModelConfig     (the DiT's shape)
    [tokens]    -> TokenConfig     (how a request becomes packed rows)
    [parallel]  -> ParallelConfig  (Ulysses / ring / tensor-parallel degrees)
    [runtime]   -> RuntimeConfig   (backend, dtype, quality tier, timeouts)
    [request]   -> RequestConfig   (the default request: ``--once`` and the benchmark)
    [serve]     -> ServeConfig     (HTTP server and request limits)
    [jobs]      -> JobsConfig      (video jobs: store, output directory, runner)

Every ``__post_init__`` raises :class:`ValueError` naming the field, its value and the rule it
breaks. Rules that need the world size (heads vs Ulysses degree, packed alignment vs world size)
are checked by :meth:`Config.check_world`, which the launcher calls on every rank before the
process group is used.

``load_config(None)`` reads the repository's ``configs/tiny.toml`` (the one copy of the default),
so ``torchrun --nproc-per-node 4 launch/serve.py`` works with no arguments from a checkout or an
editable install (``pip install -e .``).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from dist_attn.plan import heads_per_rank
from dist_attn.serve.fields import field_error, require_non_negative, require_positive
from dist_attn.serve.job_config import JobsConfig
from dist_attn.serve.quality import QualityTier, tier_backend_rule, tier_name_rule
from dist_attn.serve.tokens import TokenConfig, request_layout

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "RequestConfig",
    "ServeConfig",
    "Config",
    "DEFAULT_CONFIG_PATH",
    "load_config",
    "parse_config",
    "apply_overrides",
]

DType = Literal["auto", "bfloat16", "float16", "float32"]

#: The default config: the repository's configs/tiny.toml (found from this file, so a checkout or
#: an editable install reads the one copy; a plain wheel install has no configs/ and must pass a
#: path).
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


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
    """Attention heads (plain multi-head, no GQA). At least the Ulysses degree; need not divide
    it (the core gives the first ``num_heads % W`` ranks one extra head)."""
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
        require_positive(self, "num_layers", "hidden_size", "num_heads", "head_dim", "ffn_size",
                  "latent_channels", "freq_dim")
        require_non_negative(self, "rope_dims", "weight_seed")
        if self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise field_error("ModelConfig", "rope_dims", self.rope_dims,
                        f"must be even and at most head_dim={self.head_dim} (RoPE rotates pairs)")
        if self.freq_dim % 2:
            raise field_error("ModelConfig", "freq_dim", self.freq_dim, "must be even (sin/cos halves)")
        if not self.rope_theta > 0:
            raise field_error("ModelConfig", "rope_theta", self.rope_theta, "must be > 0")
        if not self.norm_eps > 0:
            raise field_error("ModelConfig", "norm_eps", self.norm_eps, "must be > 0")

    @property
    def inner_dim(self) -> int:
        """num_heads * head_dim: width of q, k, v and of the attention output."""
        return self.num_heads * self.head_dim


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

    def __post_init__(self) -> None:
        require_non_negative(self, "ulysses_degree")
        require_positive(self, "ring_degree", "tensor_parallel")

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
    compile: bool = False
    """torch.compile each DiT block (attention stays one opaque op inside it)."""
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
        if not isinstance(self.compile, bool):
            raise field_error("RuntimeConfig", "compile", self.compile, "must be true or false")
        rule = tier_name_rule(self.quality)
        if rule:
            raise field_error("RuntimeConfig", "quality", self.quality, rule)
        rule = tier_backend_rule(self.quality, self.backend, _registered(self.backend))
        if rule:
            raise field_error("RuntimeConfig", "backend", self.backend, rule)
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
        require_positive(self, "frames", "height", "width", "steps")
        require_non_negative(self, "num_tokens", "seed")


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
    """Largest accepted used-row count; larger requests get 413."""
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


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "tokens": TokenConfig,
    "parallel": ParallelConfig,
    "runtime": RuntimeConfig,
    "request": RequestConfig,
    "serve": ServeConfig,
    "jobs": JobsConfig,
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
    jobs: JobsConfig = field(default_factory=JobsConfig)

    def __post_init__(self) -> None:
        self.check_backend(self.runtime.backend)
        rows = request_layout(self.tokens, frames=self.request.frames, height=self.request.height,
                              width=self.request.width, num_tokens=self.request.num_tokens)
        if rows.used > self.serve.max_tokens:
            raise field_error("RequestConfig", "num_tokens" if self.request.num_tokens else "frames",
                        rows.used, f"gives {rows.used} rows, above serve.max_tokens="
                        f"{self.serve.max_tokens}")

    def check_backend(self, backend: str) -> None:
        """Raises if ``backend`` (a name, possibly resolved from "auto") cannot run head_dim."""
        registered = _registered(backend)
        allowed = registered.head_dims if registered is not None else None
        if allowed is not None and self.model.head_dim not in allowed:
            raise field_error("ModelConfig", "head_dim", self.model.head_dim,
                        f"is not supported by backend {backend!r} (accepts head_dim in "
                        f"{list(allowed)})")

    def check_world(self, world_size: int) -> None:
        """Raises :class:`ValueError` if this config cannot run on ``world_size`` ranks.

        Rules: ulysses * ring * tensor_parallel == world size; the core's head split accepts
        num_heads on the Ulysses degree (at least one head per rank; uneven splits are fine);
        alignment divisible by the world size (so every packed length, a multiple of alignment,
        splits into equal contiguous shards, and ring chunks of ulysses shards each).
        """
        p = self.parallel
        ulysses = p.resolved_ulysses(world_size)
        if ulysses * p.ring_degree * p.tensor_parallel != world_size:
            raise field_error("ParallelConfig", "ulysses_degree", ulysses,
                        f"times ring_degree={p.ring_degree} times tensor_parallel="
                        f"{p.tensor_parallel} must equal the world size {world_size}")
        try:
            heads_per_rank(self.model.num_heads, ulysses)
        except ValueError as e:
            raise field_error("ModelConfig", "num_heads", self.model.num_heads,
                        f"cannot be split over the Ulysses degree {ulysses}: {e}") from None
        if self.tokens.alignment % world_size:
            raise field_error("TokenConfig", "alignment", self.tokens.alignment,
                        f"is not divisible by the world size {world_size} (the packed length, a "
                        "multiple of alignment, must split into equal per-rank shards)")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (for logs and benchmark result files)."""
        return dataclasses.asdict(self)


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
    """Loads a TOML config file; ``None`` loads :data:`DEFAULT_CONFIG_PATH`."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.is_file():
            raise ValueError(f"no default config: {DEFAULT_CONFIG_PATH} does not exist (the "
                             "package was installed without its repository); pass a config path")
        path = DEFAULT_CONFIG_PATH
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
