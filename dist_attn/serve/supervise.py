"""``launch/serve.py --nproc-per-node N``: torchrun under a small supervisor, so that a SIGTERM
drains the server and the whole job exits 0.

Why: torchrun's agent turns a SIGTERM into a ``SignalException``, forwards the signal to its
ranks, waits for them, and then re-raises: the job exits 1 with a traceback even when every rank
drained and exited 0 (torch 2.13, ``torch/distributed/elastic/agent/server/api.py``); torchrun
has no option that makes a handled signal a clean exit. A supervisor judging by the exit status
(systemd, Kubernetes, a CI script) then reports every clean stop as a failure.

What the supervisor does instead: it starts torchrun with SIGTERM and SIGINT ignored in the
agent (``--signals-to-handle SIGHUP,SIGQUIT``, the other two set to SIG_IGN before exec), and on
SIGTERM/SIGINT it signals **rank 0** only. Rank 0 drains (queued /v1/generate requests answered
503, the running job finished or aborted between steps) and sends every rank the shutdown
message; all ranks exit 0, so the agent exits 0, and so does the supervisor. The ranks reset both
signals to their defaults at start (:func:`restore_default_signals`), so the disposition the agent
inherited does not reach them.

If the supervisor is killed (``kill -9``), the kernel kills the agent (parent-death signal
SIGKILL: it ignores SIGTERM) and each rank gets its own parent-death SIGTERM and drains.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["under_torchrun", "strip_flag", "restore_default_signals", "rank_pids", "supervise"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (or another launcher setting RANK)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag VALUE`` / ``flag=VALUE``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def restore_default_signals() -> None:
    """SIGTERM and SIGINT back to their defaults (a rank under the supervisor inherits them
    ignored; an ignored SIGTERM would also void the rank's parent-death signal)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def rank_pids(agent_pid: int) -> dict[int, int]:
    """{RANK: pid} of the agent's children (Linux /proc; empty before they started)."""
    try:
        with open(f"/proc/{agent_pid}/task/{agent_pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        return {}
    pids = {}
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            pids[int(env[b"RANK"])] = pid
    return pids


def _agent_preexec() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def supervise(nproc: int, serve_argv: list[str]) -> int:
    """Runs ``torchrun --standalone --nproc-per-node nproc -m dist_attn.serve serve_argv`` and
    returns its exit status (128 + N when it died of signal N)."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("--nproc-per-node (the supervisor) needs Linux (prctl, /proc); run "
                           "torchrun directly")
    if not (isinstance(nproc, int) and nproc >= 1):
        raise ValueError(f"--nproc-per-node={nproc!r} must be a positive integer")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "--signals-to-handle", "SIGHUP,SIGQUIT",
           "-m", "dist_attn.serve", *serve_argv]
    agent = subprocess.Popen(cmd, preexec_fn=_agent_preexec)  # noqa: PLW1509 - before exec only

    def forward(signum: int, _frame: Any) -> None:
        ranks = rank_pids(agent.pid)
        # Rank 0 decides; the others follow its shutdown message. Before the ranks exist (or if
        # rank 0 is gone) every child gets it, which at start-up ends them at once.
        targets = [ranks[0]] if 0 in ranks else list(ranks.values())
        name = signal.Signals(signum).name
        print(f"supervisor: {name}: passing it to rank 0 (pid {targets}) to drain",
              file=sys.stderr, flush=True)
        for pid in targets:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            code = agent.wait()
            break
        except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled by forward()
            time.sleep(0.1)
    return 128 - code if code < 0 else code
