# SPDX-License-Identifier: Apache-2.0
"""``python -m dist_attn.models.h3.serve`` (or ``torchrun ... -m dist_attn.models.h3.serve``): see
:mod:`dist_attn.models.h3.serve.launch.cli`."""

from dist_attn.models.h3.serve.launch import run

__all__: list[str] = []

run()
