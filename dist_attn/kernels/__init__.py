# SPDX-License-Identifier: Apache-2.0
"""Attention kernels. Importing this package never imports triton (kernels load on first call).

:mod:`dist_attn.kernels.sage8` is the attention family (its Triton, Gluon and CuTe DSL loops);
its entry points are re-exported here. Beside it, the fused kernels around an FP8 block, imported
by module: :mod:`.adaln_fp8` (norm + AdaLN modulation + FP8 row quantization), :mod:`.swiglu_fp8`
(SwiGLU + FP8 row quantization) and :mod:`.qk_norm_rope` (q/k RMSNorm + RoPE); each of these
imports triton.
"""

from dist_attn.kernels import sage8
from dist_attn.kernels.sage8 import *  # noqa: F403 - exactly sage8.__all__

__all__ = ["sage8", *sage8.__all__]
