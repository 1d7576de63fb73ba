# SPDX-License-Identifier: Apache-2.0
"""The served job's peak device memory on one rank, by arithmetic: what the launch's pre-flight
checks before any weight is loaded, and what the warm-up's measured peak is logged beside.

Parameter counts come from the real classes built on the meta device (:func:`model_sizes`: no
storage, no weights read): diffusers' ``MiniMaxH3Transformer3DModel`` from ``[model]``, the
checkpoint's Qwen3-VL text encoder (cut to the layers H3 reads) and both VAEs from their
``config.json``. :func:`estimate_peak` adds, per rank:

- resident weights: the transformer (1/W of it with ``shard_weights``, FSDP2 padding each
  parameter to a multiple of W rows), the text encoder (1/W on every rank when sharded, else
  whole on rank 0; its LM head is not loaded when sharded), the video VAE (every rank), the audio
  VAE (rank 0);
- the largest of three phases' transient memory: the text encode (the encoder's gathered root and
  ``2 + prefetch`` layers when sharded, its hidden states); a denoise step of the largest warm-up
  geometry (the transformer's gathered root and ``2 + prefetch`` blocks when sharded: the block
  running, the one prefetched and its flat all-gather buffer; one block's activations over this
  rank's rows; the full-sequence buffers before the cut); the decode (``tiles_per_call`` tiles'
  activations, the exchange buffers, the video twice);
- a fixed runtime reserve (NCCL buffers, cuBLAS/cuDNN workspaces, compiled kernels) and the
  allocator's slack as a fraction of everything.

The per-row and per-tile activation figures are planning figures; every launch logs the estimate
beside ``torch.cuda.max_memory_allocated`` after the warm-up, which checks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["Geometry", "MemoryEstimate", "ModelSizes", "Plan", "estimate_peak", "model_sizes",
           "RUNTIME_RESERVE_BYTES", "SLACK_FRACTION"]

#: NCCL communicator buffers, cuBLAS/cuDNN workspaces, compiled kernels' code: not in any tensor.
RUNTIME_RESERVE_BYTES = int(1.5e9)
#: The caching allocator's fragmentation, as a fraction of the tensors' peak.
SLACK_FRACTION = 0.08
# Bytes a block holds per row at its attention (the widest point): the residual stream and its
# norm (2 x hidden) and q, k, v with the all-to-all's send and receive buffers (9 x inner), in
# the blocks' dtype.
_ATTN_HIDDEN, _ATTN_INNER = 2, 9
# Full-sequence buffers before the cut, per row and hidden channel: the float32 input projection
# and the packed bf16 buffer (4 + 2 bytes).
_FULL_ROW_BYTES = 6


@dataclass(kw_only=True, frozen=True)
class ModelSizes:
    """Bytes of the served components as they are held (blocks in the served dtype, float32
    modules in float32), read from the classes on the meta device."""

    transformer_root: int
    """Parameters outside every block (embedders, heads, the float32 modules)."""
    transformer_units: tuple[int, ...]
    """Each refiner and transformer block, in order."""
    transformer_units_fp8: tuple[int, ...]
    """The same with FP8 block linears (e4m3 codes + float32 scales)."""
    hidden: int
    inner: int
    heads: int
    text_root: int = 0
    """The encoder's ``model`` outside its decoder layers (embedding, norm, vision tower)."""
    text_units: tuple[int, ...] = ()
    text_head: int = 0
    """The LM head (loaded only with the whole encoder on rank 0)."""
    text_width: int = 0
    vae: int = 0
    vae_width: int = 0
    """The decoder's attention width (heads x head_dim)."""
    vae_ffn_mult: int = 4
    vae_elt: int = 2
    audio_vae: int = 0
    notes: tuple[str, ...] = ()

    def transformer(self, fp8: bool) -> int:
        return self.transformer_root + sum(self.transformer_units_fp8 if fp8 else self.transformer_units)

    def text(self) -> int:
        return self.text_root + sum(self.text_units) + self.text_head


@dataclass(kw_only=True, frozen=True)
class Geometry:
    """The largest request the launch plans for (a warm-up geometry or the default request)."""

    frames: int
    height: int
    width: int
    rows: int
    """Packed rows once padded (every rank runs all of them through attention)."""
    text_rows: int
    latent_frames_per_clip: int
    """Latent frames one decoder call reads (a clip plus its overlap)."""
    spatial_compression: int


@dataclass(kw_only=True, frozen=True)
class Plan:
    """A deployment to estimate: what the config and the topology decide."""

    world: int
    rank: int
    shard: bool
    fp8: bool
    tiles_per_call: int
    elt: int = 2
    """Bytes of the blocks' dtype."""
    prefetch: int = 1


@dataclass(kw_only=True, frozen=True)
class MemoryEstimate:
    """One rank's estimated peak, term by term (bytes)."""

    plan: Plan
    resident: dict[str, int]
    phases: dict[str, dict[str, int]]
    reserve: int
    slack: int
    peak: int
    peak_phase: str
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        gb = lambda n: f"{n / 1e9:.1f}"  # noqa: E731
        res = ", ".join(f"{k} {gb(v)}" for k, v in self.resident.items() if v)
        ph = ", ".join(f"{k} {gb(v)}" for k, v in self.phases[self.peak_phase].items() if v)
        return (f"rank {self.plan.rank} of {self.plan.world}: {gb(self.peak)} GB at peak "
                f"(weights {gb(sum(self.resident.values()))}: {res}; {self.peak_phase} {ph}; "
                f"reserve {gb(self.reserve)}, allocator slack {gb(self.slack)})")


def _sharded(nbytes: int, world: int) -> int:
    """A unit's bytes on one rank: 1/W, rounded up (FSDP2 pads every parameter's rows)."""
    return math.ceil(nbytes / world)


def estimate_peak(sizes: ModelSizes, geo: Geometry, plan: Plan) -> MemoryEstimate:
    """``plan.rank``'s peak in a job of geometry ``geo`` (see the module docstring)."""
    from dist_attn.integrations.diffusers import decoder_tile_bytes

    w, elt = plan.world, plan.elt
    units = sizes.transformer_units_fp8 if plan.fp8 else sizes.transformer_units
    if plan.shard:
        transformer = sum(_sharded(u, w) for u in (*units, sizes.transformer_root))
        text = sum(_sharded(u, w) for u in (*sizes.text_units, sizes.text_root))
    else:
        transformer = sum(units) + sizes.transformer_root
        text = sizes.text() if plan.rank == 0 else 0
    resident = {"transformer": transformer, "text encoder": text, "video VAE": sizes.vae,
                "audio VAE": sizes.audio_vae if plan.rank == 0 else 0}
    gathers = 2 + plan.prefetch
    hidden_states = geo.text_rows * sizes.text_width * elt * (len(sizes.text_units) + 1)
    text_phase = {"hidden states": hidden_states if (plan.shard or plan.rank == 0) else 0,
                  "gathered": (sizes.text_root + gathers * max(sizes.text_units, default=0))
                  if plan.shard else 0}
    rows = math.ceil(geo.rows / w)
    denoise = {"gathered": (sizes.transformer_root + gathers * max(units)) if plan.shard else 0,
               "block activations": rows * elt * (_ATTN_HIDDEN * sizes.hidden + _ATTN_INNER * sizes.inner),
               "full-sequence buffers": geo.rows * sizes.hidden * _FULL_ROW_BYTES}
    c = geo.spatial_compression
    # diffusers' tile_sample_min_{height,width} for H3's VAE: 256, or the whole smaller video
    tile_h, tile_w = min(256, geo.height), min(256, geo.width)
    tile_tokens = geo.latent_frames_per_clip * (tile_h // c) * (tile_w // c)
    # the decode batch's own planning figure (one owner: the parallel decode's)
    tile_act = decoder_tile_bytes(tile_tokens, width=sizes.vae_width, ffn_mult=sizes.vae_ffn_mult,
                                  elt=sizes.vae_elt)
    tile_out = 3 * geo.latent_frames_per_clip * 4 * tile_h * tile_w * sizes.vae_elt
    video = 3 * geo.frames * geo.height * geo.width * sizes.vae_elt
    decode = {"decoder activations": plan.tiles_per_call * tile_act,
              "exchange buffers": 2 * w * plan.tiles_per_call * tile_out if w > 1 else 0,
              "video": 2 * video}
    phases = {"text encode": text_phase, "denoise": denoise, "decode": decode}
    peak_phase = max(phases, key=lambda k: sum(phases[k].values()))
    tensors = sum(resident.values()) + sum(phases[peak_phase].values())
    slack = int(SLACK_FRACTION * tensors)
    return MemoryEstimate(plan=plan, resident=resident, phases=phases,
                          reserve=RUNTIME_RESERVE_BYTES, slack=slack,
                          peak=tensors + slack + RUNTIME_RESERVE_BYTES, peak_phase=peak_phase,
                          notes=sizes.notes)


def suggestions(sizes: ModelSizes, geo: Geometry, plan: Plan, budget: int, *,
                max_world: int, frames_ok: Any, fp8_possible: bool) -> list[str]:
    """The single changes under which ``plan`` fits ``budget`` bytes, each with its estimate:
    sharding the weights, FP8 linears, more ranks (up to ``max_world``, sharded), a smaller
    decode batch, fewer frames (``frames_ok(frames) -> Geometry | None`` gives the geometry of a
    shorter video, None when that length is not valid)."""
    out = []

    def fits(p: Plan, g: Geometry = geo) -> int | None:
        e = estimate_peak(sizes, g, p)
        return e.peak if e.peak <= budget else None

    gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
    if not plan.shard and plan.world > 1 and (peak := fits(replace(plan, shard=True))):
        out.append(f"parallel.shard_weights=true ({gb(peak)})")
    if not plan.fp8 and fp8_possible and (peak := fits(replace(plan, fp8=True))):
        out.append(f'model.linear_precision="fp8" ({gb(peak)}; CUDA compute capability >= 8.9)')
    for w in range(plan.world + 1, max_world + 1):
        if sizes.heads >= w and (peak := fits(replace(plan, world=w, shard=True))):
            out.append(f"{w} ranks with parallel.shard_weights=true ({gb(peak)} a rank)")
            break
    for t in range(plan.tiles_per_call - 1, 0, -1):
        if peak := fits(replace(plan, tiles_per_call=t)):
            out.append(f"decode.tiles_per_call={t} ({gb(peak)})")
            break
    frames = geo.frames
    while frames > 5:
        frames -= 17
        shorter = frames_ok(frames)
        if shorter is not None and (peak := fits(plan, shorter)):
            out.append(f"{frames} frames or fewer at {geo.width} x {geo.height} in "
                       f"runtime.warmup_shapes and requests ({gb(peak)})")
            break
    return out


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _meta(build: Any, dtype: torch.dtype) -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return build()
    finally:
        torch.set_default_dtype(previous)


def model_sizes(model_cfg: Any, *, dtype: torch.dtype, vae_dtype: torch.dtype,
                text_config: Any = None, vae_config: dict | None = None,
                audio_vae_config: dict | None = None) -> ModelSizes:
    """:class:`ModelSizes` of the served transformer (``model_cfg``: ``[model]``) and of the
    components whose configs are given (None: not counted, and said so in ``notes``), each
    built on the meta device in the dtypes the server holds it in."""
    from dist_attn.models.h3.fp8.quantize import fp8_linear_names
    from dist_attn.models.h3.serve.h3.decode import cast_like_from_pretrained
    from dist_attn.models.h3.serve.h3.model import fp32_module_names
    from dist_attn.models.h3.serve.h3.transformer import h3_class

    model = _meta(lambda: h3_class()(**model_cfg.diffusers_config()), dtype)
    for name in fp32_module_names(model):
        model.get_submodule(name).to(torch.float32)
    blocks = list(model.token_refiner.refiner_blocks) + list(model.transformer_blocks)
    units = tuple(_bytes(b) for b in blocks)
    fp8_saving = [0] * len(model.transformer_blocks)
    for name in fp8_linear_names(model):
        w = model.get_submodule(name).weight
        fp8_saving[int(name.split(".")[1])] += w.numel() * (w.element_size() - 1) - w.shape[0] * 4
    refiners = len(model.token_refiner.refiner_blocks)
    units_fp8 = units[:refiners] + tuple(u - s for u, s in zip(units[refiners:], fp8_saving))
    notes = []
    kw: dict[str, Any] = {}
    if text_config is not None:
        from transformers import Qwen3VLForConditionalGeneration

        te = _meta(lambda: Qwen3VLForConditionalGeneration._from_config(text_config, dtype=dtype), dtype)
        layers = te.model.language_model.layers
        kw.update(text_units=tuple(_bytes(layer) for layer in layers),
                  text_root=_bytes(te.model) - sum(_bytes(layer) for layer in layers),
                  text_head=_bytes(te.lm_head), text_width=text_config.text_config.hidden_size)
    else:
        notes.append("text encoder not counted (no checkpoint config: the CPU default's tiny one)")
    if vae_config is not None:
        from diffusers import AutoencoderKLMiniMaxH3

        vae = cast_like_from_pretrained(_meta(lambda: AutoencoderKLMiniMaxH3.from_config(vae_config),
                                              torch.float32), vae_dtype)
        c = vae.config
        kw.update(vae=_bytes(vae), vae_width=c.decoder_num_attention_heads * c.decoder_attention_head_dim,
                  vae_ffn_mult=c.decoder_ffn_mult, vae_elt=torch.finfo(vae_dtype).bits // 8)
    else:
        notes.append("video VAE not counted (no checkpoint config)")
    if audio_vae_config is not None:
        from diffusers import AutoencoderKLMiniMaxH3Audio

        kw["audio_vae"] = _bytes(_meta(lambda: AutoencoderKLMiniMaxH3Audio.from_config(audio_vae_config),
                                       torch.float32))
    return ModelSizes(transformer_root=_bytes(model) - sum(units), transformer_units=units,
                      transformer_units_fp8=units_fp8, hidden=model_cfg.hidden_size,
                      inner=model_cfg.inner_dim, heads=model_cfg.num_heads, notes=tuple(notes), **kw)
