"""Attention kernels. Importing this package never imports triton (kernels load on first call)."""

from dist_attn.kernels import sage8
from dist_attn.kernels.sage8 import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    sage8_dense,
    sage8_varlen,
    unsupported_reason,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "sage8",
    "sage8_dense",
    "sage8_varlen",
    "unsupported_reason",
]
