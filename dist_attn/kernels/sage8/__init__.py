# SPDX-License-Identifier: Apache-2.0
"""Sage8: INT8-QK / FP8-PV attention for Hopper (quantization pre-pass + attention loop).

Modules: :mod:`.api` (entry points and checks; no triton), :mod:`.numerics` (the scheme's
constants), :mod:`.reference` (the scheme in plain torch), :mod:`.ops` (torch.library custom ops),
and, importing triton: :mod:`.quant` (pre-pass), :mod:`.attn_triton` and :mod:`.attn_gluon`
(attention loops; the Gluon loop's warp partitions in :mod:`.attn_gluon_partitions`), :mod:`.launch`
(one forward); importing cutlass (extra ``cute``): :mod:`.attn_cute` (the CuTe DSL loop, its
consumers' per-block steps in :mod:`.attn_cute_steps`).
"""

from dist_attn.kernels.sage8 import api
from dist_attn.kernels.sage8.api import *  # noqa: F403 - exactly api.__all__

__all__ = list(api.__all__)
