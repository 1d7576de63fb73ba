# SPDX-License-Identifier: Apache-2.0
"""The CPU default's checkpoint: a tiny random MiniMax-H3 of the real classes, built once into a
cache directory, so that ``torchrun --nproc-per-node 4 launch/serve.py`` serves the whole
pipeline on a fresh machine with no download.

Every component is the class the real checkpoint uses, at toy widths, with its own random
initialisation under a fixed seed per component:

- ``MiniMaxH3Transformer3DModel``: 4 heads x 16, hidden 32, 2 blocks + H3's 2 refiner blocks,
  RoPE on 2 * 3 * 2 = 12 of 16 head channels, text width 32.
- ``Qwen3VLForConditionalGeneration`` with 51 decoder layers of width 32: the pipeline reads
  ``hidden_states[50]`` and refuses a shallower encoder (a stack truncated to 50 layers ends in a
  norm the released weights were not trained against).
- A byte-level BPE tokenizer made with the ``tokenizers`` library (the 256 byte symbols, no
  merges: every prompt tokenizes, one row per byte) plus Qwen's vision special tokens, wrapped in
  ``Qwen2TokenizerFast``.
- ``AutoencoderKLMiniMaxH3`` with H3's temporal geometry (17-frame clips -> 5 latents, 16x
  spatial) at 8 channels and a 1-layer ViT decoder; ``AutoencoderKLMiniMaxH3Audio`` with H3's
  800-sample hop at 32 kHz (40 latents/s) through 3 upsampling stages instead of 7 (BigVGAN
  halves its channels per stage, so 7 stages need >= 128 channels).
- The two ``MiniMaxH3Scheduler``: shift 12 (video) and 3 (audio), as the pipeline describes.

The directory is written to a temporary name and renamed into place, so concurrent launches
never see half a checkpoint; under torchrun rank 0 builds and the others wait at a barrier.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable

import torch

__all__ = ["TINY_SPEC", "MARKER", "cache_dir", "tiny_spec", "tiny_checkpoint_path",
           "build_tiny_checkpoint", "ensure_tiny_checkpoint"]

#: The file that marks a directory as the generated tiny checkpoint (and records its spec).
MARKER = "dist_attn_tiny.json"

#: Everything the tiny checkpoint is made of (the transformer part is replaced by the served DiT's
#: configuration, see :func:`tiny_spec`); its hash names the cache directory, so a change here or
#: in the served config builds a new one instead of serving a stale one.
TINY_SPEC: dict[str, Any] = {
    "version": 2,
    "seed": 0,
    "text_dim": 32,
    "transformer": dict(num_attention_heads=4, attention_head_dim=16, hidden_size=32,
                        num_layers=2, num_refiner_layers=2, ffn_dim=48, in_channels=8,
                        audio_in_channels=8, patch_size=[1, 2, 2], text_dim=32, freq_dim=16,
                        time_embed_hidden_dim=24, time_embed_dim=20, rope_freq_dim=2),
    "text_encoder": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=51,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         mrope_section=[4, 2, 2]),
    "vae": dict(latent_channels=8, block_out_channels=[8, 8, 8, 8, 8, 8], layers_per_block=1,
                norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
                decoder_attention_head_dim=8, decoder_num_register_tokens=1),
    "audio_vae": dict(encoder_dim=2, latent_dim=16, latent_channels=8, num_attention_heads=2,
                      decoder_dim=16, decoder_rates=[8, 10, 10],
                      decoder_kernel_sizes=[16, 20, 20], resblock_kernel_sizes=[3],
                      resblock_dilation_sizes=[[1]]),
}

_SPECIALS = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
             "<|video_pad|>"]


def tiny_spec(transformer: dict[str, Any] | None = None) -> dict[str, Any]:
    """:data:`TINY_SPEC` around a transformer configuration (the served DiT's
    ``ModelConfig.diffusers_config()``; None: the spec's own tiny one). The components it feeds
    follow it: the text encoder's width is ``text_dim``, the video VAE's latent channels
    ``in_channels``, the audio VAE's ``audio_in_channels``."""
    spec = json.loads(json.dumps(TINY_SPEC))
    if transformer is not None:
        spec["transformer"] = json.loads(json.dumps(dict(transformer)))
    t = spec["transformer"]
    spec["text_dim"] = t["text_dim"]
    spec["text_encoder"]["hidden_size"] = t["text_dim"]
    spec["vae"]["latent_channels"] = t["in_channels"]
    spec["audio_vae"]["latent_channels"] = t["audio_in_channels"]
    spec["audio_vae"]["latent_dim"] = max(spec["audio_vae"]["latent_dim"], t["audio_in_channels"])
    spec["audio_vae"]["latent_dim"] -= spec["audio_vae"]["latent_dim"] % t["audio_in_channels"]
    return spec


def _spec_hash(spec: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def cache_dir() -> str:
    """``$DIST_ATTN_CACHE``, else ``$XDG_CACHE_HOME/dist_attn``, else ``~/.cache/dist_attn``."""
    if os.environ.get("DIST_ATTN_CACHE"):
        return os.environ["DIST_ATTN_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dist_attn")


def tiny_checkpoint_path(spec: dict[str, Any] | None = None) -> str:
    """Where the tiny checkpoint of ``spec`` (default :func:`tiny_spec`) lives."""
    return os.path.join(cache_dir(), f"h3-tiny-{_spec_hash(spec or tiny_spec())}")


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    return Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                              pad_token="<|endoftext|>", unk_token=None, bos_token=None)


def _text_encoder_config(te: dict[str, Any], tok: Any) -> Any:
    """The tiny Qwen3-VL's config: the text stack of ``te`` over ``tok``'s vocabulary, a one-block
    vision tower, and ``tok``'s ids of the vision special tokens."""
    from transformers import Qwen3VLConfig

    ids = {s: tok.convert_tokens_to_ids(s) for s in _SPECIALS}
    return Qwen3VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=te["hidden_size"],
                         intermediate_size=te["intermediate_size"],
                         num_hidden_layers=te["num_hidden_layers"],
                         num_attention_heads=te["num_attention_heads"],
                         num_key_value_heads=te["num_key_value_heads"],
                         head_dim=te["head_dim"],
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                          "mrope_section": te["mrope_section"],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=te["hidden_size"], patch_size=16,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])


def _builders(spec: dict[str, Any], tok: Any) -> dict[str, Callable[[], Any]]:
    """Component directory name -> a function that builds it of ``spec`` with random weights (in
    the order they are seeded)."""
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio,
                           MiniMaxH3Transformer3DModel)
    from transformers import Qwen3VLForConditionalGeneration

    te_cfg = _text_encoder_config(spec["text_encoder"], tok)
    v = dict(spec["vae"], block_out_channels=tuple(spec["vae"]["block_out_channels"]))
    channels = v["latent_channels"]
    a = spec["audio_vae"]
    return {
        "transformer": lambda: MiniMaxH3Transformer3DModel(
            **dict(spec["transformer"], patch_size=tuple(spec["transformer"]["patch_size"]))),
        "text_encoder": lambda: Qwen3VLForConditionalGeneration(te_cfg),
        "vae": lambda: AutoencoderKLMiniMaxH3(**v, latents_mean=(0.0,) * channels,
                                              latents_std=(1.0,) * channels),
        "audio_vae": lambda: AutoencoderKLMiniMaxH3Audio(
            latents_mean=[0.0] * a["latent_channels"], latents_std=[1.0] * a["latent_channels"],
            **dict(a, decoder_rates=tuple(a["decoder_rates"]),
                   decoder_kernel_sizes=tuple(a["decoder_kernel_sizes"]),
                   resblock_kernel_sizes=tuple(a["resblock_kernel_sizes"]),
                   resblock_dilation_sizes=tuple(tuple(d) for d in
                                                 a["resblock_dilation_sizes"]))),
    }


def build_tiny_checkpoint(path: str, spec: dict[str, Any] | None = None) -> str:
    """Builds the tiny checkpoint of ``spec`` (default :func:`tiny_spec`) into ``path`` (which
    must not exist) atomically; returns it."""
    from diffusers import MiniMaxH3Scheduler

    spec = spec or tiny_spec()
    seed = spec["seed"]
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".h3-tiny-", dir=parent)
    try:
        tok = _tokenizer()
        for i, (name, build) in enumerate(_builders(spec, tok).items()):
            torch.manual_seed(seed * 1000 + i)  # one seed per component: order-independent
            build().eval().save_pretrained(os.path.join(tmp, name))
        MiniMaxH3Scheduler(shift=12.0).save_pretrained(os.path.join(tmp, "scheduler"))
        MiniMaxH3Scheduler(shift=3.0).save_pretrained(os.path.join(tmp, "audio_scheduler"))
        tok.save_pretrained(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(spec, f, indent=1)
        os.rename(tmp, path)  # atomic; fails if another launch won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def ensure_tiny_checkpoint(env: Any = None, transformer: dict[str, Any] | None = None) -> str:
    """The directory of the tiny checkpoint around ``transformer`` (see :func:`tiny_spec`),
    built first if absent (rank 0 builds, every rank waits at a barrier)."""
    import logging

    import torch.distributed as dist

    spec = tiny_spec(transformer)
    path = tiny_checkpoint_path(spec)
    rank0 = env is None or env.rank == 0
    if rank0 and not os.path.isfile(os.path.join(path, MARKER)):
        logging.getLogger(__name__).info("building the tiny random H3 checkpoint into %s (once)",
                                         path)
        build_tiny_checkpoint(path, spec)
    if env is not None and env.distributed:
        dist.barrier()
    return path
