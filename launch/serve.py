"""Serve the DiT on torchrun's ranks: the project's main job (flags: ``--help``).

    torchrun --nproc-per-node 4 launch/serve.py                       # tiny, CPU gloo, :8000
    torchrun --nproc-per-node 4 launch/serve.py --config configs/h3.toml --quality high
"""

from dist_attn.serve.launch import run

if __name__ == "__main__":
    run()
