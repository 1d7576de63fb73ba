# SPDX-License-Identifier: Apache-2.0
"""Quantized weights as :mod:`dist_attn.weight_sharding` shards them: the protocol a module with
quantized tensors meets, the FP8 linear a package registers to replace torchao's FP8 linears, and
the two passes that prepare a model for FSDP2 (which shards parameters only).

The library imports no model code: a package with FP8 linears (``dist_attn.models.h3.fp8``)
registers its module here when it is imported.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["Fp8LinearFactory", "HoldsQuantizedTensors", "check_torchao_linears", "fp8_buffers_to_parameters",
           "quantized_names", "register_fp8_linear", "torchao_to_fp8_linear"]


@runtime_checkable
class HoldsQuantizedTensors(Protocol):
    """A module whose quantized tensors (e4m3 codes, float32 scales) :func:`shard_module` shards
    as raw bytes: ``quantized`` names them, each a buffer of the module (or, once sharded, a
    frozen parameter of the same name). The module keeps their dtypes through casts itself."""

    quantized: tuple[str, ...]


class Fp8LinearFactory(Protocol):
    """Builds the bias-free FP8 linear that takes a torchao FP8 linear's place before sharding:
    ``factory(codes, scales, fast_accum=...)`` with ``codes [N, K]`` float8_e4m3fn and ``scales``
    the ``N`` float32 per-row scales (``[N, 1]`` or ``[N]``); the module it returns computes the
    same per-row recipe and holds ``codes`` and ``scales`` as named in its ``quantized``."""

    def __call__(self, codes: torch.Tensor, scales: torch.Tensor, *, fast_accum: bool
                 ) -> HoldsQuantizedTensors: ...


_FP8_LINEAR: list[Fp8LinearFactory] = []


def register_fp8_linear(factory: Fp8LinearFactory) -> None:
    """Sets the module that :func:`shard_module` puts in place of each torchao FP8 linear (the
    last registration wins). A package that quantizes to torchao's FP8 recipe registers its module
    when it is imported."""
    _FP8_LINEAR[:] = [factory]


def quantized_names(module: nn.Module) -> tuple[str, ...]:
    """The names ``module`` gives its quantized tensors (:class:`HoldsQuantizedTensors`); ``()``
    for a module without a ``quantized`` tuple."""
    names = getattr(module, "quantized", ())
    return names if isinstance(names, tuple) else ()


def _torchao_linears(root: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every ``nn.Linear`` under ``root`` whose weight is a torchao FP8 tensor."""
    return [(name, m) for name, m in root.named_modules()
            if isinstance(m, nn.Linear) and hasattr(getattr(m, "weight", None), "qdata")]


def _unswappable(name: str, module: nn.Linear) -> str | None:
    """Why the torchao FP8 linear ``module`` cannot become the registered FP8 linear, or None."""
    w = module.weight
    if module.bias is not None:
        return (f"{name}: a torchao FP8 linear with a bias; shard_module makes torchao's FP8 linears "
                "Fp8Linear, which is bias-free")
    if w.scale.numel() != w.qdata.shape[0]:
        return (f"{name}: torchao FP8 weight with scales of shape {tuple(w.scale.shape)}; shard_module "
                f"takes the per-row recipe (one scale per output channel, {w.qdata.shape[0]})")
    if not _FP8_LINEAR:
        return (f"{name}: a torchao FP8 linear, and no FP8 linear module is registered to hold its "
                "codes as parameters (register_fp8_linear; importing dist_attn.models.h3.fp8 "
                "registers its Fp8Linear)")
    return None


def check_torchao_linears(root: nn.Module) -> None:
    """ValueError naming the first torchao FP8 linear under ``root`` that
    :func:`torchao_to_fp8_linear` could not replace (a bias, scales that are not per row, no FP8
    linear registered): for a caller that must refuse before it changes anything."""
    _refuse_unswappable(_torchao_linears(root))


def _refuse_unswappable(linears: list[tuple[str, nn.Linear]]) -> None:
    """ValueError for the first of ``linears`` that :func:`_unswappable` names."""
    for name, module in linears:
        problem = _unswappable(name, module)
        if problem is not None:
            raise ValueError(problem)


def torchao_to_fp8_linear(root: nn.Module) -> int:
    """Every ``nn.Linear`` whose weight is a torchao FP8 tensor (``qdata``/``scale``) -> the
    registered FP8 linear (:func:`register_fp8_linear`) on the same codes and scales (its
    ``fast_accum`` from the tensor's ``mm_config``). Returns how many; ValueError (before any
    swap) as :func:`check_torchao_linears`."""
    linears = _torchao_linears(root)
    _refuse_unswappable(linears)
    swaps = []
    for name, module in linears:
        w = module.weight
        fast = bool(getattr(getattr(w, "mm_config", None), "use_fast_accum", False))
        swaps.append((name, _FP8_LINEAR[0](w.qdata, w.scale, fast_accum=fast)))
    for name, new in swaps:
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent), child, new)
    return len(swaps)


def fp8_buffers_to_parameters(root: nn.Module) -> int:
    """The quantized tensors of every :class:`HoldsQuantizedTensors` module become frozen
    parameters of the same names (FSDP2 shards parameters only). Returns how many tensors."""
    n = 0
    for module in root.modules():
        for name in [k for k in quantized_names(module) if module._buffers.get(k) is not None]:
            t = module._buffers.pop(name)
            module.register_parameter(name, nn.Parameter(t, requires_grad=False))
            n += 1
    return n
