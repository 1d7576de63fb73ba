# SPDX-License-Identifier: Apache-2.0
"""H3's FP8 linears: the recipe (:mod:`.linear`, its numbers in :mod:`.numerics`), the fused
Triton kernels around an FP8 block (:mod:`.swiglu_kernel`, :mod:`.adaln_kernel`), the block forward
that feeds them (:mod:`.block`, :mod:`.fusions`) and the one call that swaps a transformer's
linears (:mod:`.quantize`). Importing this package imports neither triton nor torchao.
"""

from dist_attn.models.h3.fp8.quantize import (LINEAR_PRECISIONS, LinearPrecision,
                                              LinearQuantization, fp8_linear_names,
                                              quantize_linears)

__all__ = ["LINEAR_PRECISIONS", "LinearPrecision", "LinearQuantization", "fp8_linear_names",
           "quantize_linears"]
