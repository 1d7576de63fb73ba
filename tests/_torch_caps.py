# SPDX-License-Identifier: Apache-2.0
"""What this torch build can do on the CPU, for tests whose expectation depends on it."""

from __future__ import annotations

import pytest
import torch


def cpu_rowwise_scaled_mm_refusal() -> str | None:
    """None when the CPU ``torch._scaled_mm`` takes per-row scales (torchao's recipe passes them;
    torch 2.13's CPU kernel does), else the first line of its error (torch 2.11's asserts
    per-tensor scales)."""
    codes = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(codes, codes.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:200]
    return None


def require_cpu_rowwise_scaled_mm() -> None:
    """Skips the calling test unless this torch's CPU ``torch._scaled_mm`` takes per-row scales."""
    refusal = cpu_rowwise_scaled_mm_refusal()
    if refusal:
        pytest.skip(f"torch {torch.__version__}: CPU torch._scaled_mm refuses per-row scales ({refusal})")
