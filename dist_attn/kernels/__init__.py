# SPDX-License-Identifier: Apache-2.0
"""Attention kernels. Importing this package never imports triton (kernels load on first call).

One family today, :mod:`dist_attn.kernels.sage8`; its entry points are re-exported here.
"""

from dist_attn.kernels import sage8
from dist_attn.kernels.sage8 import *  # noqa: F403 - exactly sage8.__all__

__all__ = ["sage8", *sage8.__all__]
