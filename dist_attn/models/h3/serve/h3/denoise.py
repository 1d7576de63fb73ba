# SPDX-License-Identifier: Apache-2.0
"""The ``t2va`` core denoise as the server runs it: diffusers' own blocks around a loop of ours that
asks a hook after every step whether every rank goes on (:func:`ServedDenoise`)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from dist_attn.models.h3.serve.wire.abort import Abort

__all__ = ["DenoiseHook", "ServedDenoise"]

#: A denoise hook inside the pipeline: ``hook(k, n)`` after step k of n -> the verdict of every rank.
DenoiseHook = Callable[[int, int], Abort]


def _served_loop_cls() -> type:
    """diffusers' t2va denoise loop with a step hook (:class:`ServedDenoiseLoop`), built lazily
    (diffusers and transformers load on first use)."""
    from diffusers.modular_pipelines.minimax_h3.denoise import (MiniMaxH3DenoiseLoopWrapper,
                                                                MiniMaxH3LoopDenoiser,
                                                                MiniMaxH3LoopSchedulerStep)
    from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam

    class ServedDenoiseLoop(MiniMaxH3DenoiseLoopWrapper):
        """diffusers' loop body (one forward, one scheduler step per modality); after each step
        ``step_hook(k, n)`` returns every rank's verdict, and the loop stops on a non-NONE one."""

        model_name = "minimax-h3"
        block_classes = [MiniMaxH3LoopDenoiser, MiniMaxH3LoopSchedulerStep]
        block_names = ["denoiser", "update"]

        @property
        def loop_inputs(self) -> list:
            return [*super().loop_inputs,
                    InputParam(name="step_hook", required=True,
                               description="hook(k, n) after step k of n -> Abort verdict")]

        @property
        def loop_intermediate_outputs(self) -> list:
            return [OutputParam("aborted", description="Abort verdict that stopped the loop"),
                    OutputParam("steps_done", type_hint=int, description="Steps that ran")]

        @torch.no_grad()
        def __call__(self, components: Any, state: Any) -> tuple[Any, Any]:
            block_state = self.get_block_state(state)
            n = len(block_state.timesteps)
            block_state.aborted, block_state.steps_done = Abort.NONE, 0
            for i, t in enumerate(block_state.timesteps):
                components, block_state = self.loop_step(components, block_state, i=i, t=t)
                block_state.steps_done = i + 1
                verdict = block_state.step_hook(i + 1, n)
                if verdict is not Abort.NONE:
                    block_state.aborted = verdict
                    break
            self.set_block_state(state, block_state)
            return components, state

    return ServedDenoiseLoop


def _served_denoise_cls() -> type:
    """The t2va core denoise of diffusers' blocks with our loop (:func:`_served_loop_cls`), built
    lazily (diffusers and transformers load on first use)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3NoKeyframeAnchorsStep, MiniMaxH3PrepareLatentsStep, MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep)
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep
    from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec

    class ServedDenoise(SequentialPipelineBlocks):
        """diffusers' t2va core denoise (``MiniMaxH3CoreDenoiseStep``'s blocks) with
        :class:`ServedDenoiseLoop`; declares the VAEs, whose geometry the layout reads."""

        model_name = "minimax-h3"
        block_classes = [MiniMaxH3NoKeyframeAnchorsStep, MiniMaxH3PrepareLayoutStep,
                         MiniMaxH3PrepareLatentsStep, MiniMaxH3SetTimestepsStep,
                         _served_loop_cls(), MiniMaxH3AfterDenoiseStep]
        block_names = ["no_keyframe_anchors", "prepare_layout", "prepare_latents",
                       "set_timesteps", "denoise", "after_denoise"]

        @property
        def expected_components(self) -> list:
            return [*super().expected_components, ComponentSpec("vae", AutoencoderKLMiniMaxH3),
                    ComponentSpec("audio_vae", AutoencoderKLMiniMaxH3Audio)]

    return ServedDenoise


def ServedDenoise() -> Any:  # noqa: N802 - a class made lazily
    """An instance of the served t2va denoise blocks (see :func:`_served_denoise_cls`)."""
    return _served_denoise_cls()()
