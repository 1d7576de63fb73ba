"""The served MiniMax H3 (diffusers' ``MiniMaxH3Transformer3DModel``), built on the dist_attn
library (which never imports this package).

Layers, bottom up: ``fields`` / ``tokens`` / ``quality`` -> ``config`` -> ``model`` / ``weights``
-> ``protocol`` (request schema) -> ``jobs`` (rank-0 bookkeeping) -> ``wire`` (rank-to-rank
control) -> ``engine`` (denoise loop) -> ``metrics`` / ``http`` (rank 0) -> ``loop`` (rank
loops) -> ``process`` / ``checks`` / ``logs`` / ``warmup`` -> ``cli`` (the one launcher; ``config``
checks ``warmup``'s shape rules, which import the layers above them only when called). Entry point:
``python -m dist_attn.serve`` or ``torchrun ... launch/serve.py``. Needs the ``serve`` extra
(starlette, uvicorn, prometheus_client, safetensors, accelerate) and the ``diffusers`` extra
(the model).
"""

from dist_attn.serve.config import Config, load_config
from dist_attn.serve.h3.model import build_h3, compile_blocks, parallelize
from dist_attn.serve.config.quality import DeviceFacts, Topology, quality_failures
from dist_attn.serve.h3.weights import WeightsError, load_output, save_output

__all__ = [
    "Config",
    "DeviceFacts",
    "Topology",
    "WeightsError",
    "build_h3",
    "compile_blocks",
    "load_config",
    "load_output",
    "parallelize",
    "quality_failures",
    "save_output",
]
