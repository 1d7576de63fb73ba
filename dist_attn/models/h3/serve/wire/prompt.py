# SPDX-License-Identifier: Apache-2.0
"""Rank 0's prompt encoding on every rank: the text encoder runs once, on rank 0
(:mod:`dist_attn.models.h3.serve.h3.pipeline` says why), and its output travels as two broadcasts. A
sharded encoder runs on every rank, on rank 0's prompt text (:func:`broadcast_text`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.wire.control import comm_device

__all__ = ["broadcast_prompt", "broadcast_text"]


def broadcast_text(text: str | None, env: DistEnv) -> str:
    """Rank 0's ``text`` on every rank (the other ranks pass None): its UTF-8 length, then its
    bytes (none for an empty text), two broadcasts from rank 0."""
    if not env.distributed:
        assert text is not None
        return text
    cd = comm_device(env)
    data = text.encode() if env.rank == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=cd)
    dist.broadcast(n, src=0)
    size = int(n.item())
    if size == 0:
        return ""
    if env.rank == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(cd)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=cd)
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes().decode()


def broadcast_prompt(embeds: torch.Tensor | None, tags: torch.Tensor | None, env: DistEnv,
                     *, dtype: torch.dtype, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's prompt encoding on every rank: two broadcasts (the shape, then the values).

    Args:
        embeds: [1, T, D] the text encoder's hidden state (rank 0; None elsewhere).
        tags: [T] int64 modality tags of the text rows (rank 0; None elsewhere).
    Returns:
        ([1, T, D] in ``dtype`` on ``device``, [T] int64 on ``device``) on every rank.
    """
    if not env.distributed:
        assert embeds is not None and tags is not None
        return embeds.to(device, dtype), tags.to(device)
    cd = comm_device(env)
    shape = torch.zeros(2, dtype=torch.int64, device=cd)
    if env.rank == 0:
        shape[0], shape[1] = embeds.shape[1], embeds.shape[2]
    dist.broadcast(shape, src=0)
    t, d = (int(x) for x in shape.tolist())
    # float32 on the wire: gloo has no bfloat16 broadcast on every build, and 5 MB is nothing
    buf = torch.empty(1, t, d + 1, dtype=torch.float32, device=cd)
    if env.rank == 0:
        buf[0, :, :d] = embeds[0].to(cd, torch.float32)
        buf[0, :, d] = tags.to(cd, torch.float32)
    dist.broadcast(buf, src=0)
    return buf[:, :, :d].to(device, dtype), buf[0, :, d].round().to(device, torch.int64)
