# SPDX-License-Identifier: Apache-2.0
"""What compiling the served blocks asks of the config: the warm-up's steps, Dynamo's raised
recompile limit, the sequence bucket, and the rules that keep a launch's warm-up inside them."""

from __future__ import annotations

from typing import Any

__all__ = ["COMPILED_SEQUENCE_BUCKET", "SERVED_RECOMPILE_LIMIT", "WARMUP_LENGTHS_MAX", "WARMUP_STEPS",
           "sequence_bucket_rule", "warmup_bound_rule", "warmup_shapes_rule"]

#: Denoise steps the launch's warm-up runs of each ``runtime.warmup_shapes`` geometry: the first
#: step's shapes (video and audio share one timestep) and every later step's (two).
WARMUP_STEPS = 2

#: Dynamo's ``recompile_limit`` while the served blocks are compiled (torch's default: 8). Each
#: padded sequence length (a geometry's bucket: ``runtime.sequence_bucket``) takes two entries
#: of the block's code (the first step has one distinct timestep, the later ones two). The
#: default let a server compile four lengths and fail the fifth (fullgraph raises); 64 covers
#: 32, on every rank alike.
SERVED_RECOMPILE_LIMIT = 64

#: Padded lengths a launch's warm-up may compile: half of what :data:`SERVED_RECOMPILE_LIMIT`
#: holds, so that lengths met later (longer prompts, geometries not warmed) still compile.
WARMUP_LENGTHS_MAX = SERVED_RECOMPILE_LIMIT // 4

#: ``runtime.sequence_bucket = "auto"`` with compiled blocks: rows the packed sequence is padded
#: to a multiple of. A video job's sequence holds its prompt's tokens, so without buckets every
#: prompt length compiled the blocks anew (and the 33rd failed its job). Prompts of 1 to 512
#: tokens fall in at most two buckets of a geometry, for at most 511 padding rows (1.3% of H3's
#: 37,980 at h3-ref) of work outside the attention, which never computes them.
COMPILED_SEQUENCE_BUCKET = 512


def warmup_shapes_rule(shapes: Any) -> str | None:
    """The broken format rule of ``runtime.warmup_shapes`` (None: fine); the geometries
    themselves are checked against H3's request rules by :class:`Config`."""
    if not isinstance(shapes, (list, tuple)) or not all(
            isinstance(s, (list, tuple)) and len(s) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in s)
            for s in shapes):
        return "must be a list of [frames, height, width] triples of positive integers"
    return None


def sequence_bucket_rule(bucket: Any, quality: str | None) -> str | None:
    """The broken rule of ``runtime.sequence_bucket`` (None: fine)."""
    if bucket != "auto" and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        return "must be a positive integer (rows) or \"auto\""
    if quality == "lossless" and bucket not in ("auto", 1):
        return ("pads each rank's rows, which may change how the GEMMs round, and "
                "quality='lossless' serves the eager bf16 path bit for bit (use 1 or \"auto\")")
    return None


def warmup_bound_rule(shapes: tuple, prompt_tokens: int, bucket: int | str, *, text_tokens: int,
                      may_compile: bool) -> str | None:
    """The broken rule of ``runtime.warmup_prompt_tokens`` (None: fine): where the blocks may
    compile, the padded lengths the warm-up compiles (at most ``ceil(prompt_tokens / bucket) + 1``
    a geometry whatever the world size, one more when the stand-in's ``text_tokens`` lies
    outside ``[1, prompt_tokens]``) may take at most half of Dynamo's raised recompile limit,
    leaving the other half to the lengths jobs bring later."""
    if not may_compile:
        return None
    rows = COMPILED_SEQUENCE_BUCKET if bucket == "auto" else bucket
    per_shape = -(-prompt_tokens // rows) + 1 + (not 1 <= text_tokens <= prompt_tokens)
    lengths = len(shapes) * per_shape
    if lengths <= WARMUP_LENGTHS_MAX:
        return None
    return (f"with {len(shapes)} warmup_shapes, buckets of {rows} rows and tokens.text_tokens="
            f"{text_tokens}, may compile up to {lengths} padded lengths at launch, more than "
            f"{WARMUP_LENGTHS_MAX}: half of what Dynamo's raised recompile limit holds "
            f"({SERVED_RECOMPILE_LIMIT} entries, two a length), the other half left to later jobs; "
            "raise sequence_bucket, or lower warmup_prompt_tokens or the number of shapes")
