# SPDX-License-Identifier: Apache-2.0
"""The served model: diffusers' MiniMax-H3 built, loaded, made sequence-parallel and compiled, the
/v1/generate denoise engine, the t2va pipeline that runs video jobs, the CPU default's checkpoint."""

from dist_attn.models.h3.serve.h3.engine import Engine, RunResult
from dist_attn.models.h3.serve.h3.model import build_h3, compile_blocks, parallelize
from dist_attn.models.h3.serve.h3.pipeline import H3Pipeline, H3Runner
from dist_attn.models.h3.serve.h3.weights import WeightsError, load_output, save_output

__all__ = ["Engine", "H3Pipeline", "H3Runner", "RunResult", "WeightsError", "build_h3",
           "compile_blocks", "load_output", "parallelize", "save_output"]
