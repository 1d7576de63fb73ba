# SPDX-License-Identifier: Apache-2.0
"""Text encoding: the Qwen3-VL encoder H3 conditions on, loaded only as deep as H3 reads it, and the
processor ``t2va`` needs (a text-only stand-in where transformers cannot build Qwen3VLProcessor
without torchvision). Either rank 0 holds the whole encoder (:func:`load_text_encoder`) or every
rank holds 1/W of it (:func:`load_text_encoder_sharded`, FSDP2 one decoder layer at a time, with
``parallel.shard_weights``) and every rank runs it; either way rank 0's output reaches the other
ranks through :func:`dist_attn.models.h3.serve.wire.prompt.broadcast_prompt`, so every rank
conditions on the same tensor by construction."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

__all__ = ["H3_TEXT_LAYER", "TextOnlyQwen3VLProcessor", "load_processor", "load_text_encoder",
           "load_text_encoder_sharded", "shard_text_encoder", "text_encoder_units"]

log = logging.getLogger(__name__)


def _text_only_processor_cls() -> type:
    from transformers.processing_utils import ProcessorMixin

    class TextOnlyQwen3VLProcessor(ProcessorMixin):
        """A processor over the tokenizer alone, for text-only ``t2va``: transformers'
        ``create_mm_token_type_ids`` with the image/video pad ids Qwen3VLProcessor would read."""

        def __init__(self, tokenizer: Any) -> None:
            self.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
            self.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
            super().__init__(tokenizer)

    return TextOnlyQwen3VLProcessor


def TextOnlyQwen3VLProcessor(tokenizer: Any) -> Any:  # noqa: N802 - a class made lazily
    """See :func:`_text_only_processor_cls` (transformers is imported on first use only)."""
    return _text_only_processor_cls()(tokenizer)


#: The Qwen3-VL hidden state H3 conditions on (``MiniMaxH3ModularPipeline.text_encoder_layer``).
H3_TEXT_LAYER = 50


def load_text_encoder(cls: Any, path: str, *, dtype: torch.dtype, device: torch.device) -> Any:
    """The text encoder with only the decoder layers H3 reads: ``hidden_states[50]`` is the
    output of layer 50 whatever follows it, so layers 51+ are not loaded (the 64-layer, 5,120-wide
    Qwen3-VL is ~67 GB in bf16; 51 layers ~54 GB, next to a 66 GB transformer on rank 0). One
    layer more than 50 is kept: the pipeline refuses a stack of exactly 50 (its last state is
    post-norm)."""
    config = _cut_config(path)
    model = cls.from_pretrained(path, config=config, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def _cut_config(path: str) -> Any:
    """The encoder's config with at most ``H3_TEXT_LAYER + 1`` decoder layers (logged)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    full = config.text_config.num_hidden_layers
    keep = min(full, H3_TEXT_LAYER + 1)
    config.text_config.num_hidden_layers = keep
    if hasattr(config.text_config, "layer_types") and config.text_config.layer_types:
        config.text_config.layer_types = config.text_config.layer_types[:keep]
    if keep < full:
        log.info("text encoder: loading %d of its %d decoder layers (H3 reads hidden_states[%d])",
                 keep, full, H3_TEXT_LAYER)
    return config


def text_encoder_units(encoder: Any) -> list[str]:
    """The FSDP2 units of a Qwen3-VL encoder's ``model`` (what H3's text step calls): its decoder
    layers, in order; the embedding, the final norm and the vision tower are the root."""
    return [f"language_model.layers.{i}" for i in range(len(encoder.model.language_model.layers))]


def load_text_encoder_sharded(cls: Any, path: str, *, dtype: torch.dtype, device: torch.device,
                              group: Any = None) -> Any:
    """The text encoder as :func:`load_text_encoder` loads it, its ``model`` sharded over the
    ranks of ``group`` with FSDP2 (one unit per decoder layer, gathered as it runs), built on the
    meta device and read from the checkpoint one layer at a time: no rank holds the whole
    encoder. Call it on every rank; every rank must then run the encoder on the same prompt (each
    layer's gather is a collective). The language-model head, which H3's text step never calls
    (it reads ``text_encoder.model``'s hidden states), stays on the meta device, unloaded.

    Raises:
        WeightsError: the checkpoint lacks a tensor of the encoder or has another shape.
    """
    from dist_attn.models.h3.serve.h3.weights import CheckpointTensors

    reader = CheckpointTensors(path)
    return shard_text_encoder(cls, _cut_config(path), dtype=dtype, device=device, group=group,
                              materialize=lambda name, module: reader.fill(
                                  f"model.{name}" if name else "model", module))


def shard_text_encoder(cls: Any, config: Any, *, dtype: torch.dtype, device: torch.device,
                       materialize: Any, group: Any = None) -> Any:
    """``cls`` of ``config`` built on the meta device, its ``model`` materialised one decoder
    layer at a time by ``materialize(name, module)`` (names relative to ``model``) and sharded
    over ``group`` (FSDP2, :func:`text_encoder_units`); the LM head stays on meta. What
    :func:`load_text_encoder_sharded` runs with a checkpoint's tensors, and a benchmark with a
    random fill."""
    from dist_attn.weight_sharding import parameters_on_meta, shard_module

    with torch.device(device), parameters_on_meta():
        model = cls._from_config(config, dtype=dtype)
    model = model.eval().requires_grad_(False)
    shard_module(model.model, text_encoder_units(model), group, materialize=materialize,
                 device=device)
    return model


def load_processor(checkpoint: str, tokenizer: Any) -> Any:
    path = os.path.join(checkpoint, "processor")
    reason = f"{path} does not exist"
    if os.path.isdir(path):
        try:
            from transformers import Qwen3VLProcessor

            return Qwen3VLProcessor.from_pretrained(path)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            # Without torchvision, transformers' video-processor mapping is a placeholder and
            # building the processor fails inside transformers.
            reason = f"Qwen3VLProcessor could not be built ({type(e).__name__}: {e}; it needs " \
                     "torchvision for its video processor)"
    log.info("processor: %s; t2va uses it only to mark image/video tokens (none in a text "
             "prompt), so a text-only processor over the same tokenizer stands in", reason)
    return TextOnlyQwen3VLProcessor(tokenizer)
