# SPDX-License-Identifier: Apache-2.0
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
    the option that put the kernel there nor what to do instead. ``setting``: that option, as the
    caller turns it off (e.g. ``"quantize_linears(fuse_adaln=False)"``). The forward is
    unchanged, with grad on too; nothing is saved for the backward. torch.compile traces the
    backward at the first forward when an input requires grad (a diffusers model's parameters
    do, by default), so the message says first how to run inference."""
    name = op._qualname

    def backward(ctx, *grads):
        raise RuntimeError(f"{name} has no backward: the fused kernels are for inference. Run "
                           "inference under torch.no_grad() or torch.inference_mode(), or after "
                           "model.requires_grad_(False) (torch.compile traces the backward "
                           "whenever an input requires grad). An FP8-quantized model is for "
                           "inference whatever the options (torchao's FP8 linears have no backward "
                           f"either): train the bf16 model and quantize it after; {setting} "
                           "removes only this kernel")

    op.register_autograd(backward)
