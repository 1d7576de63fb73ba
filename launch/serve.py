# SPDX-License-Identifier: Apache-2.0
"""Serve the DiT on torchrun's ranks: the project's main job (flags: ``--help``).

    torchrun --nproc-per-node 4 launch/serve.py                       # tiny, CPU gloo, :8000
    torchrun --nproc-per-node 4 launch/serve.py --config configs/h3.toml --quality high
"""

import signal
import sys

try:
    from dist_attn.models.h3.serve.launch import run  # imports diffusers and the HTTP stack: seconds per rank
except KeyboardInterrupt:
    # Ctrl-C reached a rank still importing (a slow peer): it ends as a stopped rank, quietly;
    # rank 0 or the supervisor says why in one line
    sys.exit(128 + int(signal.SIGINT))

if __name__ == "__main__":
    run()
