# SPDX-License-Identifier: Apache-2.0
"""The text encoder sharded over the ranks (parallel.shard_weights): every rank holds 1/W of the
tiny checkpoint's Qwen3-VL (FSDP2, one unit per decoder layer, read from the checkpoint one layer
at a time), every rank runs it on rank 0's prompt (the others' requests carry none), and every
rank conditions on exactly what the whole encoder on rank 0 gives."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("av")

from tests._multirank import run_ranks  # noqa: E402

PROMPT = "a red fox runs through fresh snow at dawn"


class _Calls:
    """Stands in for the encoder step: calls ``fn`` (a module's __call__ cannot be patched on
    the instance)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _worker(rank, world, path):
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3VLForConditionalGeneration

    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.pipeline import H3Runner
    from dist_attn.models.h3.serve.h3.text import load_text_encoder

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                  backend="gloo")
    runner = H3Runner.build(load_config(None), env, dtype=torch.float32, backend="sdpa",
                            checkpoint=path, shard_text=True)
    pipe = runner.pipe
    te = pipe.comps.text_encoder
    layers = te.model.language_model.layers
    sharded = all(isinstance(p, DTensor) for p in te.model.parameters())
    share = sum(p.to_local().numel() for p in te.model.parameters()) / sum(
        p.numel() for p in te.model.parameters())
    # every rank runs the encoder (rank 0 as the job's lead, the others as followers, whose
    # request carries no prompt: a job's control message holds its integers only) on rank 0's
    # prompt: what each rank's encoder step is called with is recorded
    encoded = []
    step_call = pipe.text.__call__

    def recording(*args, **kwargs):
        encoded.append(kwargs.get("prompt"))
        return step_call(*args, **kwargs)

    pipe.text = _Calls(recording)
    embeds, tags, _ = pipe.encode(PROMPT if rank == 0 else "")
    again, _, _ = pipe.encode("another prompt" if rank else PROMPT)  # every layer gathered again
    # the reference: the whole encoder, as rank 0 alone loads it without sharding
    whole = load_text_encoder(Qwen3VLForConditionalGeneration, os.path.join(path, "text_encoder"),
                              dtype=torch.float32, device=torch.device("cpu"))
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    step = MiniMaxH3TextEncoderStep().init_pipeline()
    step.update_components(text_encoder=whole, tokenizer=pipe.comps.tokenizer,
                           processor=pipe.comps.processor)
    out = step(prompt=PROMPT, output=["prompt_embeds", "text_token_tags"])
    return {"equal": torch.equal(embeds, out["prompt_embeds"].float()) and torch.equal(
                tags, out["text_token_tags"].to(tags.device)),
            "again": torch.equal(again, embeds), "sharded": sharded, "share": share,
            "units": len(layers), "head_unloaded": te.lm_head.weight.is_meta,
            "flag": pipe.text_sharded, "encoded": encoded}


@pytest.mark.parametrize("world", [2])
def test_every_rank_runs_its_share_of_the_encoder_and_gets_rank0s_output(tmp_path, world):
    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.tiny import build_tiny_checkpoint, tiny_spec

    path = build_tiny_checkpoint(str(tmp_path / "h3-tiny"),
                                 tiny_spec(load_config(None).model.diffusers_config()))
    for res in run_ranks(_worker, world, tmp_path, path, timeout=300):
        assert res["equal"] and res["again"] and res["sharded"] and res["flag"], res
        assert res["encoded"] == [PROMPT, PROMPT], res["encoded"]  # rank 0's, on every rank
        assert res["units"] == 51 and res["head_unloaded"], res
        assert res["share"] <= 1 / world + 0.05, res


def _text_worker(rank, world):
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.wire import broadcast_text

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                  backend="gloo")
    texts = ["a fox \N{FOX FACE} runs, na\u00efve \u2014 \u00fc", "", "x" * 5000]
    return [broadcast_text(t if rank == 0 else None, env) for t in texts], texts


def test_rank0s_text_reaches_every_rank(tmp_path):
    """broadcast_text: rank 0's prompt, multi-byte UTF-8, empty or long, on every rank (the
    others pass None)."""
    for got, want in run_ranks(_text_worker, 3, tmp_path):
        assert got == want
