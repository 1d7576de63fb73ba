"""What the fused kernels' custom ops share (no triton import here)."""

from __future__ import annotations

import os

import torch

__all__ = ["forward_only", "launchable"]


def launchable(x: torch.Tensor) -> bool:
    """Whether the kernels run on ``x``'s device: a GPU, or the CPU under Triton's interpreter."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def forward_only(op, setting: str) -> None:
    """Registers a backward for the custom op ``op`` that raises a clear error: the fused kernels
    are inference-only, and torch's own message (no autograd formula registered) names neither
    the option that put the kernel there nor the way back. ``setting``: that option, as the
    caller turns it off (e.g. ``"quantize_linears(fuse_adaln=False)"``). The forward is
    unchanged, with grad on too; nothing is saved for the backward."""
    name = op._qualname

    def backward(ctx, *grads):
        raise RuntimeError(f"{name} has no backward: the fused kernels are for inference. To "
                           f"train through this layer, build it with {setting}")

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)
