# SPDX-License-Identifier: Apache-2.0
"""The served DiT: diffusers' ``MiniMaxH3Transformer3DModel`` itself, made sequence-parallel by
:func:`dist_attn.integrations.diffusers.enable_ulysses`.

Every rank holds the full (replicated) weights and calls the model with the same full inputs;
inside, each rank's blocks work on 1/W of the packed rows and every block's self-attention is one
pair of all-to-alls (or Ulysses x Ring over a mesh). There is no model code here: only how the
class is built (its own seeded initialisation, or a diffusers-format checkpoint), in which dtypes
(bf16 blocks with the fp32 modules the class declares; the blocks' linears in FP8 when
``model.linear_precision = "fp8"``), and how its blocks are compiled.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from torch import nn

from dist_attn.models.h3.serve.config.sections import SERVED_RECOMPILE_LIMIT, ModelConfig
from dist_attn.models.h3.serve.h3.transformer import h3_class
from dist_attn.models.h3.serve.h3.weights import load_checkpoint

__all__ = ["SERVED_RECOMPILE_LIMIT", "build_h3", "compile_blocks", "fp32_module_names", "meta_h3",
           "parallelize", "raise_recompile_limit", "shard_h3"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def fp32_module_names(model: nn.Module) -> list[str]:
    """The submodules the class keeps in float32 (``_keep_in_fp32_modules``, matched against a
    whole component of the module's dotted name, as diffusers' loader matches parameter names):
    H3's two input projections, time MLP, two output heads and RoPE."""
    keep = set(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    names = []
    for name, _ in model.named_modules():
        parts = name.split(".") if name else []
        if parts and parts[-1] in keep and not any(n for n in names if name.startswith(n + ".")):
            names.append(name)
    return names


def _own_init(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The class's own random initialisation, drawn on ``device`` from ``cfg.weight_seed`` (the
    same weights on every rank of one device type), the blocks in ``dtype``.

    The model is created directly on the device in ``dtype`` (H3 at 50 layers: 33B parameters,
    66 GB in bf16, never in float32 on the host); the fp32 modules are then cast up and drawn
    again in float32 by their own ``reset_parameters``.
    """
    cls = h3_class()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.weight_seed)
        with torch.device(device), _default_dtype(dtype):
            model = cls(**cfg.diffusers_config())
        if dtype != torch.float32:
            for name in fp32_module_names(model):
                module = model.get_submodule(name).to(torch.float32)
                for sub in module.modules():
                    if hasattr(sub, "reset_parameters"):
                        sub.reset_parameters()
    return model


def build_h3(cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype,
             checkpoint: str | None = None) -> nn.Module:
    """The served ``MiniMaxH3Transformer3DModel`` on ``device``, in eval mode, no grad.

    With ``cfg.linear_precision = "fp8"`` the blocks' q/k/v/out and FFN linears are then quantized
    (with fast accumulation when ``cfg.fp8_fast_accum``) in place
    (:func:`dist_attn.models.h3.fp8.quantize_linears`, which logs the layer count and the bytes
    saved; with ``cfg.fp8_fused_kernels``, its default, on CUDA the FFNs' SwiGLU and the norms +
    AdaLN run fused with their quantization); on a device without FP8 GEMMs that raises, naming the
    device.

    Args:
        cfg: the architecture (``[model]``); a checkpoint must have the same (checked).
        device: where the weights live (every rank its own device).
        dtype: dtype of the blocks (bf16 on CUDA); the class's fp32 modules stay float32.
        checkpoint: a diffusers-format directory (``config.json`` + safetensors weights) loaded
            with ``from_pretrained``; None draws the class's own initialisation from
            ``cfg.weight_seed``.
    """
    if checkpoint is None:
        model = _own_init(cfg, device, dtype)
    else:
        model = load_checkpoint(checkpoint, cfg, device=device, dtype=dtype)
    model = model.eval().requires_grad_(False)
    if cfg.linear_precision != "bf16":
        from dist_attn.models.h3.fp8 import quantize_linears

        fused = "auto" if cfg.fp8_fused_kernels else False
        quantize_linears(model, cfg.linear_precision, fast_accum=cfg.fp8_fast_accum,
                         fuse_swiglu=fused, fuse_adaln=fused)
    return model


def meta_h3(cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype,
            fp32_modules: bool = False) -> nn.Module:
    """The served class with its parameters on the meta device (no storage: H3's 66 GB are not
    allocated) and its buffers on ``device`` (RoPE's frequencies, computed by the constructor),
    in eval mode, no grad: what :func:`shard_h3` materialises block by block. The blocks' dtype
    is ``dtype``; ``fp32_modules``: the class's float32 modules already float32 (for a
    checkpoint; the own initialisation draws them in ``dtype`` first, as :func:`build_h3` does)."""
    from dist_attn.weight_sharding import parameters_on_meta

    with torch.device(device), _default_dtype(dtype), parameters_on_meta():
        model = h3_class()(**cfg.diffusers_config())
    if fp32_modules and dtype != torch.float32:
        for name in fp32_module_names(model):
            model.get_submodule(name).to(torch.float32)
    return model.eval().requires_grad_(False)


def shard_h3(model: nn.Module, cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype,
             checkpoint: str | None = None, group: Any = None) -> Any:
    """Materialises a :func:`meta_h3` model and shards it over ``group`` (FSDP2, one unit per
    refiner and transformer block: :func:`dist_attn.integrations.diffusers.shard_weights`' plan),
    one block at a time, so that no rank ever holds more than its shards and one block: the
    weights are :func:`build_h3`'s, bit for bit (the class's own initialisation drawn from
    ``cfg.weight_seed`` in the constructor's order, the float32 modules drawn again in float32;
    or ``checkpoint``'s tensors, read block by block), and with FP8 linears each block is
    quantized between its materialisation and its sharding. Call it after ``enable_ulysses``
    (:func:`parallelize`) and before :func:`compile_blocks`. Returns the
    :class:`dist_attn.weight_sharding.ShardedWeights`.

    Raises:
        WeightsError: the checkpoint lacks a tensor, has another shape, or holds tensors the
            model has no parameter for.
    """
    from dist_attn.integrations.diffusers import weight_units
    from dist_attn.models.h3.fp8 import quantize_linears
    from dist_attn.models.h3.serve.h3.weights import (CheckpointTensors, WeightsError,
                                                      check_checkpoint)
    from dist_attn.weight_sharding import shard_module

    reader = None
    if checkpoint is not None:
        check_checkpoint(checkpoint, cfg)
        reader = CheckpointTensors(checkpoint)
    fp32 = fp32_module_names(model)
    fused = "auto" if cfg.fp8_fused_kernels else False

    def materialize(name: str, module: nn.Module) -> None:
        if reader is not None:
            reader.fill(name, module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    def prepare(name: str, module: nn.Module) -> None:
        if name.startswith("transformer_blocks.") and cfg.linear_precision != "bf16":
            quantize_linears(model, cfg.linear_precision, fast_accum=cfg.fp8_fast_accum,
                             fuse_swiglu=fused, fuse_adaln=fused, blocks=(int(name.split(".")[1]),))
        if name == "" and reader is None and dtype != torch.float32:
            for fp32_name in fp32:  # drawn again in float32, after everything, as _own_init does
                for sub in model.get_submodule(fp32_name).to(torch.float32).modules():
                    if hasattr(sub, "reset_parameters"):
                        sub.reset_parameters()

    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.weight_seed)
        summary = shard_module(model, weight_units(model), group, materialize=materialize,
                               prepare=prepare, device=device)
    if reader is not None and reader.unread():
        raise WeightsError(f"--checkpoint {checkpoint}: tensors the served model has no "
                           f"parameter for: {', '.join(reader.unread()[:8])}")
    return summary


def parallelize(model: nn.Module, *, mesh: Any = None, backend: str, timer: Any = None,
                overlap_chunks: int = 1, sequence_bucket: int = 1) -> Any:
    """``enable_ulysses`` over the default group (or ``mesh`` for Ulysses x Ring), its attention
    calls pipelined in ``overlap_chunks`` head chunks (``[parallel] overlap_chunks``), the
    sequence padded to ``sequence_bucket`` rows (``runtime.sequence_bucket``, resolved); returns
    the handle. Single-process: the model runs as one rank with dist_attn's kernel."""
    from dist_attn.integrations.diffusers import enable_ulysses

    return enable_ulysses(model, mesh=mesh, backend=backend, timer=timer,
                          overlap_chunks=overlap_chunks, sequence_bucket=sequence_bucket)


def raise_recompile_limit() -> None:
    """Dynamo's ``recompile_limit`` raised to :data:`SERVED_RECOMPILE_LIMIT` for the whole
    process (never lowered, never restored; logged as a warning): the served sequence lengths
    take two cache entries each, the compiled decoder one per tile batch shape."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    if getattr(config, name) < SERVED_RECOMPILE_LIMIT:
        log.warning("torch._dynamo.config.%s %d -> %d for this process (two entries a served "
                    "sequence length, one a decoder batch shape)", name, getattr(config, name),
                    SERVED_RECOMPILE_LIMIT)
        setattr(config, name, SERVED_RECOMPILE_LIMIT)


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> None:
    """``torch.compile(fullgraph=True, dynamic=False)`` of every transformer block (what diffusers'
    ``compile_repeated_blocks`` does for each block class it lists): the blocks share their code,
    so one compilation serves every layer of a shape; dist_attn's attention is one opaque custom
    op in the graph, and enable_ulysses' hooks run eagerly between the blocks. The two token
    refiner blocks stay eager: their rows are the prompt's tokens, so compiled they would compile
    for every prompt length, for ~0.1% of a step's work (2 blocks over a few hundred rows against
    50 over the sequence).
    FP8 linears (torchao's ``Float8Tensor`` weights) trace too: inductor fuses the activation
    quantization of q/k/v, the output projection and the FFN's projection (per-row amax, scale,
    e4m3 cast) around ``torch._scaled_mm``; the down projection's input comes quantized from the
    fused SwiGLU custom op, and (``quantize_linears``' default ``fuse_adaln="auto"`` on CUDA) the
    q/k/v and FFN projection inputs from the fused norm + AdaLN custom op. Call it after the quantization
    (build_h3 does that).

    ``dynamic=False`` (the benchmarks' setting; ``compile_kwargs`` may override it): each geometry
    gets kernels specialised to its shapes, where Dynamo's default would recompile the second
    geometry with symbolic ones. Raises Dynamo's ``recompile_limit`` to
    :data:`SERVED_RECOMPILE_LIMIT` for the whole process, never lowers it, never restores it
    (logged as a warning), so that the sequence lengths a server meets do not run out of cache
    entries before the 33rd."""
    raise_recompile_limit()
    compile_kwargs.setdefault("dynamic", False)
    compile_kwargs.setdefault("fullgraph", True)
    for block in model.transformer_blocks:
        block.compile(**compile_kwargs)
