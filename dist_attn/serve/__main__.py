"""``python -m dist_attn.serve`` (or ``torchrun ... -m dist_attn.serve``): see
:mod:`dist_attn.serve.launch.cli`."""

import sys

from dist_attn.serve.launch import main

__all__: list[str] = []

sys.exit(main())
