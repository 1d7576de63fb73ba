# SPDX-License-Identifier: Apache-2.0
"""Attention kernels. Importing this package never imports triton (kernels load on first call).

:mod:`dist_attn.kernels.sage8` is the attention family (its Triton, Gluon and CuTe DSL loops);
its entry points are re-exported here. Beside it, imported by module, :mod:`.qk_norm_rope`
(q/k RMSNorm + RoPE before the attention; imports triton). The fused kernels of H3's FP8 block
live with the model, in :mod:`dist_attn.models.h3.fp8`.
"""

from dist_attn.kernels import sage8
from dist_attn.kernels.sage8 import *  # noqa: F403 - exactly sage8.__all__

__all__ = ["sage8", *sage8.__all__]
