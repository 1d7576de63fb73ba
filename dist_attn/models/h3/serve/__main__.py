# SPDX-License-Identifier: Apache-2.0
"""``python -m dist_attn.serve`` (or ``torchrun ... -m dist_attn.serve``): see
:mod:`dist_attn.serve.launch.cli`."""

from dist_attn.serve.launch import run

__all__: list[str] = []

run()
