"""Text encoding on rank 0: the Qwen3-VL encoder H3 conditions on, loaded only as deep as H3 reads
it, and the processor ``t2va`` needs (a text-only stand-in where transformers cannot build
Qwen3VLProcessor without torchvision). Its output reaches the other ranks through
:func:`dist_attn.serve.wire.prompt.broadcast_prompt`."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

__all__ = ["H3_TEXT_LAYER", "TextOnlyQwen3VLProcessor", "load_processor", "load_text_encoder"]

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
    model = cls.from_pretrained(path, config=config, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


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
