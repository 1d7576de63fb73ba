# SPDX-License-Identifier: Apache-2.0
"""The numbers of the FP8 linear recipe, shared by :mod:`.linear` and the fused kernels
(:mod:`.swiglu_kernel`, :mod:`.adaln_kernel`), so that no kernel imports the module that launches it.

Importing this module costs torch only (no triton, no torchao).
"""

from __future__ import annotations

import torch

__all__ = ["ACTIVATION_AMAX_FLOOR", "ADALN_MAX_HIDDEN", "E4M3_MAX", "SWIGLU_MAX_INNER"]

#: The largest finite float8_e4m3fn value.
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: Floor of an activation row's max |x| (torchao's ``activation_value_lb``): an all-zero row
#: quantizes to zero codes instead of 0/0 = NaN.
ACTIVATION_AMAX_FLOOR = 1e-12
#: Widest SwiGLU output row (the FFN's inner size) that
#: :class:`~dist_attn.models.h3.fp8.linear.Fp8SwiGLUFeedForward`'s kernel holds in one program's
#: registers.
SWIGLU_MAX_INNER = 16384
#: Widest row (a block's hidden size) that
#: :func:`dist_attn.models.h3.fp8.adaln_kernel.adaln_e4m3_rows` holds in one program's registers.
ADALN_MAX_HIDDEN = 16384
