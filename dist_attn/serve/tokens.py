"""How a request becomes packed rows: the token rules and the packed layout of one request."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dist_attn.serve.fields import field_error, require_non_negative, require_positive

__all__ = ["TokenConfig", "PackedLayout", "request_layout"]


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
        require_positive(self, "spatial_compression", "temporal_compression", "alignment")
        require_non_negative(self, "extra_latent_frames", "text_tokens", "audio_tokens")


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


def request_layout(tok: TokenConfig, *, frames: int, height: int, width: int,
                   num_tokens: int = 0) -> PackedLayout:
    """Packed layout of a request under ``tok``; raises ValueError naming the offending request
    field."""
    if num_tokens:
        if num_tokens < 0:
            raise field_error("request", "num_tokens", num_tokens, "must be a positive integer")
        used, shape = num_tokens, None
    else:
        for name, value in (("height", height), ("width", width)):
            if value % tok.spatial_compression:
                raise field_error("request", name, value, "must be a multiple of "
                            f"tokens.spatial_compression={tok.spatial_compression}")
        shape = ((frames - 1) // tok.temporal_compression + 1 + tok.extra_latent_frames,
                 height // tok.spatial_compression, width // tok.spatial_compression)
        used = math.prod(shape) + tok.text_tokens + tok.audio_tokens
    total = -(-used // tok.alignment) * tok.alignment
    return PackedLayout(used=used, total=total, latent_shape=shape)
