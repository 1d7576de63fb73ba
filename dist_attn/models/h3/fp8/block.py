# SPDX-License-Identifier: Apache-2.0
"""MiniMax-H3 blocks whose FP8 GEMM inputs are quantized by the pass that computes them.

An H3 block feeds each of its two GEMM groups (``attn.to_q/to_k/to_v``, then the FFN's
projection) ``RMSNorm(x) * (1 + scale[idx]) + shift[idx]``; with FP8 linears the recipe then
quantizes that bf16 tensor per row. :func:`fuse_adaln_blocks` gives each such block a forward
that computes the modulated input and its e4m3 codes in one pass
(:func:`dist_attn.models.h3.fp8.adaln_kernel.adaln_e4m3_rows`; before the FFN the same pass also
does the attention's residual step,
:func:`~dist_attn.models.h3.fp8.adaln_kernel.residual_adaln_e4m3_rows`, which rounds it as
diffusers' bf16 ops do) and hands the linears the codes
(:class:`dist_attn.models.h3.fp8.linear.Fp8Rows`): the GEMMs are the recipe's, only the pass before
them changes (see the kernel's docstring for its roundings). The forward is diffusers' block
(``MiniMaxH3TransformerBlock.forward`` of diffusers 0.42) step for step otherwise; the attention
processor is whatever the block has (diffusers', or dist_attn's Ulysses one): both call
``attn.to_q/to_k/to_v`` on what the block passes, which is all they do with it.

The forward is set on each block instance (``block.forward``), as diffusers' own hooks do: fuse
before registering such hooks (a block whose forward is already replaced is refused). The swapped
projections hold ``weight_codes`` / ``weight_scales`` buffers, so a fused model's state dict does
not load into an unfused one: quantize the checkpoint's bf16 weights instead.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dist_attn.models.h3.fp8.linear import (EmulatedFp8Linear, Fp8Linear, Fp8Rows,
                                            Fp8SwiGLUFeedForward, fused_input_dtype_error)
from dist_attn.models.h3.fp8.numerics import ADALN_MAX_HIDDEN

__all__ = ["adaln_unfusable_reason", "fuse_adaln_blocks"]


def _takes_rows(module: nn.Module) -> bool:
    return isinstance(module, (Fp8Linear, EmulatedFp8Linear))


def _ffn_proj(ff: nn.Module) -> tuple[nn.Module, str] | None:
    """(the FFN's input projection, its name under ``ff``), for a fused FFN or diffusers' SwiGLU
    ``FeedForward``; None for anything else."""
    if isinstance(ff, Fp8SwiGLUFeedForward):
        return ff.proj, "proj"
    net = getattr(ff, "net", None)
    if isinstance(net, nn.ModuleList) and len(net) == 3 and hasattr(net[0], "proj"):
        from diffusers.models.activations import SwiGLU

        if isinstance(net[0], SwiGLU):
            return net[0].proj, "net.0.proj"
    return None


def adaln_unfusable_reason(block: nn.Module, *, quantized: bool = True) -> str | None:
    """Why ``block`` cannot take the fused forward (None: it can): it must be diffusers'
    ``MiniMaxH3TransformerBlock`` with ``nn.RMSNorm`` norms over at most ``ADALN_MAX_HIDDEN``
    channels, separate q/k/v projections and a SwiGLU FFN, their input linears bias-free and FP8
    (torchao's or emulated; ``Fp8Linear`` once swapped); ``quantized=False``: bias-free
    ``nn.Linear`` layers that the quantization will make FP8."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    if type(block) is not MiniMaxH3TransformerBlock:
        return f"{type(block).__name__} is not diffusers' MiniMaxH3TransformerBlock"
    if "forward" in vars(block):
        # a diffusers hook (context parallelism, offloading, caches) or an earlier fusion: the
        # fused forward would replace it without a word, and removing the hook would undo it
        return ("its forward is already replaced on the instance (a diffusers hook, or fused "
                "before): quantize before registering hooks")
    for name in ("norm1", "norm2"):
        norm = getattr(block, name)
        if type(norm) is not nn.RMSNorm or len(norm.normalized_shape) != 1 or norm.eps is None:
            return (f"{name} is {type(norm).__name__}"
                    f"(shape={tuple(getattr(norm, 'normalized_shape', ()))}, eps={getattr(norm, 'eps', None)}), "
                    "not an nn.RMSNorm over the last dim with an explicit eps")
        if norm.normalized_shape[0] > ADALN_MAX_HIDDEN:
            return f"{name} normalizes {norm.normalized_shape[0]} channels, over the kernel's {ADALN_MAX_HIDDEN}"
    if getattr(block.attn, "fused_projections", False):
        return "attn runs a fused to_qkv projection"
    proj = _ffn_proj(block.ff)
    if proj is None:
        return f"ff is {type(block.ff).__name__}, not a SwiGLU feed-forward"
    for name, lin in (("attn.to_q", block.attn.to_q), ("attn.to_k", block.attn.to_k),
                      ("attn.to_v", block.attn.to_v), (f"ff.{proj[1]}", proj[0])):
        fp8 = _takes_rows(lin) or hasattr(getattr(lin, "weight", None), "qdata")
        if not (fp8 if quantized else type(lin) is nn.Linear):
            want = "an FP8 linear" if quantized else "an nn.Linear"
            return f"{name} is not {want} ({type(lin).__name__})"
        if getattr(lin, "bias", None) is not None:
            return f"{name} has a bias"
    return None


def _as_rows_linear(linear: nn.Module, fast_accum: bool) -> nn.Module:
    """A torchao FP8 linear -> :class:`Fp8Linear` on the same codes and scales; an emulated one
    (which takes rows already) as it is."""
    if _takes_rows(linear):
        return linear
    return Fp8Linear(linear.weight.qdata, linear.weight.scale, fast_accum=fast_accum)


def _forward(self: nn.Module, hidden_states: torch.Tensor, temb: torch.Tensor,
             adaln_indices: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor],
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' H3 block, the two AdaLN inputs quantized as they are computed (the second with
    the attention's residual step in the same pass)."""
    from dist_attn.models.h3.fp8.adaln_kernel import adaln_e4m3_rows, residual_adaln_e4m3_rows

    if hidden_states.dtype != torch.bfloat16:
        raise fused_input_dtype_error(f"hidden_states.dtype={hidden_states.dtype}", "an H3 block",
                                      "fuse_adaln")
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(temb)
    rows = Fp8Rows(*adaln_e4m3_rows(hidden_states, self.norm1.weight, self.norm1.eps, scale_msa,
                                    shift_msa, adaln_indices))
    attn_output = self.attn(rows, rotary_emb, attention_mask)
    hidden_states, *rows = residual_adaln_e4m3_rows(hidden_states, gate_msa, attn_output, self.norm2.weight,
                                                    self.norm2.eps, scale_mlp, shift_mlp, adaln_indices)
    return hidden_states + gate_mlp.index_select(0, adaln_indices) * self.ff(Fp8Rows(*rows))


def fuse_adaln_blocks(blocks: list[tuple[int, nn.Module]], fast_accum: bool) -> tuple[str, ...]:
    """Gives each (already FP8) block the fused forward, its q/k/v and FFN input projections as
    :class:`Fp8Linear` (same weights); returns the blocks' names. The caller has checked
    :func:`adaln_unfusable_reason`."""
    for _, block in blocks:
        for name in ("to_q", "to_k", "to_v"):
            setattr(block.attn, name, _as_rows_linear(getattr(block.attn, name), fast_accum))
        proj, where = _ffn_proj(block.ff)
        owner = block.ff if where == "proj" else block.ff.net[0]
        owner.proj = _as_rows_linear(proj, fast_accum)
        block.forward = functools.partial(_forward, block)  # a partial pickles; a bound method does not
    return tuple(f"transformer_blocks.{i}" for i, _ in blocks)
