"""The served H3-shaped DiT, built on the dist_attn library (which never imports this package).

Layers, bottom up: ``fields`` / ``tokens`` / ``quality`` -> ``config`` -> ``model`` / ``weights``
-> ``protocol`` (request schema) -> ``jobs`` (rank-0 bookkeeping) -> ``wire`` (rank-to-rank
control) -> ``engine`` (denoise loop) -> ``metrics`` / ``http`` (rank 0) -> ``loop`` (rank
loops) -> ``process`` / ``checks`` / ``logs`` -> ``cli`` (the one launcher). Entry point:
``python -m dist_attn.serve`` or ``torchrun ... launch/serve.py``. Needs the ``serve`` extra
(starlette, uvicorn, prometheus_client) for HTTP.
"""

from dist_attn.serve.config import Config, load_config
from dist_attn.serve.model import DiT, DiTBlock, build_model
from dist_attn.serve.quality import DeviceFacts, Topology, quality_failures
from dist_attn.serve.weights import WeightsError, load_safetensors, load_weights, save_safetensors

__all__ = [
    "Config",
    "DeviceFacts",
    "DiT",
    "DiTBlock",
    "Topology",
    "WeightsError",
    "build_model",
    "load_config",
    "load_safetensors",
    "load_weights",
    "quality_failures",
    "save_safetensors",
]
