# SPDX-License-Identifier: Apache-2.0
"""Run a function on N gloo ranks in fresh processes, with a hard time limit.

Each test gets its own ``file://`` rendezvous under ``tmp_path`` so pytest-xdist workers never
collide. Without CUDA, ranks are forked from a forkserver that has imported torch, dist_attn and
diffusers once per pytest worker: a spawned rank paid 2.3 s (torch) to 7.7 s (with the diffusers
adapter) of imports on CI's 2 cores, so a 4-rank test spent up to 30 CPU-seconds importing before
its first collective. The forkserver itself runs no torch op, so the forked ranks start with no
threads. With CUDA, ranks are spawned (see :func:`_context`). A rank that raises reports the
exception instead of its result; a rank still running at the deadline fails the test (that is how
a hang in a collective shows up).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback

__all__ = ["run_ranks", "RankError"]


class RankError:
    """What a rank raised: exception type name, message and traceback text."""

    def __init__(self, exc: BaseException) -> None:
        self.type = type(exc).__name__
        self.message = str(exc)
        self.traceback = traceback.format_exc()

    def __repr__(self) -> str:
        return f"RankError({self.type}: {self.message})"


def _entry(fn, rank, world, init_file, out_q, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        out_q.put((rank, result))
    except BaseException as exc:  # report, never hang the parent
        out_q.put((rank, RankError(exc)))


#: Imported once by the forkserver; a module that is not installed is skipped by the forkserver.
_PRELOAD = ["torch", "torch.distributed", "numpy", "dist_attn", "dist_attn.integrations.diffusers",
            "diffusers", "tests.reference"]


def _context():
    import torch

    if torch.cuda.is_available():
        # A preloaded module may touch CUDA at import (likely torchao, which diffusers imports,
        # asking for the device capability), and a rank forked from a process with CUDA
        # initialised cannot use it: "Cannot re-initialize CUDA in forked subprocess" (seen on an
        # H100, 2026-12-05). On a GPU machine every multi-rank test, gloo ones included, pays the
        # imports of a fresh interpreter instead; CI (no GPU) keeps the forkserver.
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn, world_size: int, tmp_path, *args, timeout: float = 120.0, check: bool = True) -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns results by rank.

    With ``check=True`` a rank that raised fails the call with its traceback.
    """
    ctx = _context()
    init_file = os.path.join(str(tmp_path), f"rdzv_{world_size}_{os.getpid()}_{id(fn)}")
    out_q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_file, out_q, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} of {world_size} did not "
                    f"finish within {timeout:.0f}s (hung in a collective?)"
                )
            try:
                rank, res = out_q.get(timeout=min(left, 1.0))
                results[rank] = res
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(results) < world_size:
                    # give the queue a moment: a rank may have reported just before exiting
                    try:
                        rank, res = out_q.get(timeout=2.0)
                        results[rank] = res
                        continue
                    except queue.Empty:
                        raise AssertionError(
                            f"a rank process died with exit code {dead[0].exitcode} without reporting"
                        ) from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    ordered = [results[r] for r in range(world_size)]
    if check:
        for r, res in enumerate(ordered):
            if isinstance(res, RankError):
                raise AssertionError(f"rank {r} raised {res.type}: {res.message}\n{res.traceback}")
    return ordered
