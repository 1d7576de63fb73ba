# SPDX-License-Identifier: Apache-2.0
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
inherited does not reach them. A SIGTERM or SIGINT that comes before rank 0 serves has nothing to
drain: the supervisor kills the agent and the ranks at once and exits 128 + the signal, with one
line (a rank stopped mid start-up left its peers failing with tracebacks, and the agent printed
its own ``ChildFailedError``).

If the supervisor is killed (``kill -9``), the kernel kills the agent (parent-death signal
SIGKILL: it ignores SIGTERM) and each rank gets its own parent-death SIGTERM and drains.

Restarts: a ``kill -9`` of one rank ends the torchrun job (it exits 1). The supervisor starts
torchrun again when the job fails after it served (rank 0 writes the file
named by ``$DIST_ATTN_SUPERVISOR_READY`` once its HTTP port serves,
:func:`dist_attn.models.h3.serve.ranks.lifecycle.mark_ready`), at most
``--max-restarts`` times (3) within :data:`RESTART_WINDOW_S` (10 minutes). The job store then
re-queues the job that was running, as after any crash (a job started twice already is failed,
not retried: :data:`dist_attn.models.h3.serve.jobs.store.MAX_ATTEMPTS`). A job that fails before it
serves (a bad config, a port in use, a corrupt job store) is not restarted: it would fail the same
way. The restarted job is a fresh torchrun (new ranks, the model built again), on the same port.
torchrun's own ``--max-restarts`` is not used: it restarts launch failures too, and its count
never resets, so a server up for months would run out of restarts. While no rank 0 serves (a
start, a restart), the supervisor keeps the port open and answers it with 503 and Retry-After
(:mod:`dist_attn.models.h3.serve.launch.keeper`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from dist_attn.models.h3.serve.launch.keeper import KEEPER_ENV, PortKeeper

__all__ = ["under_torchrun", "strip_flag", "restore_default_signals", "rank_pids", "supervise",
           "DEFAULT_MAX_RESTARTS", "RESTART_WINDOW_S"]

#: Restarts allowed within :data:`RESTART_WINDOW_S` (``--max-restarts``).
DEFAULT_MAX_RESTARTS = 3
#: The window over which restarts are counted: a rare fault never exhausts them.
RESTART_WINDOW_S = 600.0
# How often the supervisor looks again for the ranks of a signal it could not deliver yet.
_POLL_S = 0.2

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


def ignores(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has ``sig`` set to SIG_IGN (Linux /proc; False once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _agent_preexec() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _kill(pids: list[int], sig: signal.Signals) -> None:
    """``sig`` to each of ``pids``; one already gone is skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def supervise(nproc: int, serve_argv: list[str], *,
              max_restarts: int = DEFAULT_MAX_RESTARTS) -> int:
    """Runs ``torchrun --standalone --nproc-per-node nproc -m dist_attn.models.h3.serve serve_argv``
    and returns its exit status (128 + N when it died of signal N), restarting it after a failure
    that came after it served (module docstring)."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("--nproc-per-node (the supervisor) needs Linux (prctl, /proc); run "
                           "torchrun directly")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc-per-node={nproc!r} must be a positive integer")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"--max-restarts={max_restarts!r} must be a non-negative integer "
                         f"(restarts within {RESTART_WINDOW_S:g} s; 0: never restart)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "--signals-to-handle", "SIGHUP,SIGQUIT",
           "-m", "dist_attn.models.h3.serve", *serve_argv]
    job = _Supervisor(cmd, max_restarts)
    signal.signal(signal.SIGTERM, job.forward)
    signal.signal(signal.SIGINT, job.forward)
    # here, not at the top: the launch imports this module before it checks the serve extra,
    # and the ranks' package imports the HTTP app (uvicorn)
    from dist_attn.models.h3.serve.ranks.lifecycle import READY_ENV

    with tempfile.TemporaryDirectory(prefix="dist_attn-supervisor-") as tmp:
        job.ready = os.path.join(tmp, "ready")
        keeper = PortKeeper(tmp)  # answers the port while no rank 0 serves
        env = dict(os.environ, **{READY_ENV: job.ready, KEEPER_ENV: keeper.path})
        try:
            return job.run(env, keeper)
        finally:
            keeper.close()


class _Supervisor:
    """What :func:`supervise`'s loop shares with its SIGTERM/SIGINT handler (:meth:`forward`):
    the running agent, the stop signal, whether it still waits for the ranks, the file rank 0
    writes once it serves, and the restarts made."""

    def __init__(self, cmd: list[str], max_restarts: int) -> None:
        self.cmd, self.max_restarts = cmd, max_restarts
        self.agent: subprocess.Popen | None = None
        self.stop: str | None = None  # the signal's name once one arrived
        self.undelivered = False
        self.ready: str | None = None  # the file rank 0 writes once it serves
        self.early: int | None = None  # the exit status of a launch stopped before it served
        self.restarts: list[float] = []

    def forward(self, signum: int, _frame: Any) -> None:
        if self.stop is None:
            self.stop = signal.Signals(signum).name
        # Before the ranks exist, or accept SIGTERM, the signal waits for them (it was lost at
        # start-up).
        self.undelivered = not self.deliver()

    def deliver(self) -> bool:
        """SIGTERM to rank 0 (or every rank when rank 0 is gone); False before the ranks exist
        or while a target still ignores SIGTERM: a rank inherits SIG_IGN from the agent until
        :func:`restore_default_signals` runs, and a SIGTERM sent before that was lost (the job
        kept serving; found by killing the soak driver, whose server got its parent-death
        SIGTERM while the ranks started). Before the job serves there is nothing to drain: the
        agent and the ranks are killed at once, quietly (a rank stopped mid start-up left its
        peers failing with tracebacks, and the agent printed its own)."""
        agent = self.agent
        if agent is not None and not (self.ready and os.path.exists(self.ready)):
            print(f"supervisor: {self.stop} before the server was up: ending the launch",
                  file=sys.stderr, flush=True)
            _kill([agent.pid, *rank_pids(agent.pid).values()], signal.SIGKILL)
            self.early = 128 + int(signal.Signals[self.stop])
            return True
        ranks = rank_pids(agent.pid) if agent is not None else {}
        # Rank 0 decides; the others follow its shutdown message.
        targets = [ranks[0]] if 0 in ranks else list(ranks.values())
        if not targets or any(ignores(pid, signal.SIGTERM) for pid in targets):
            return False
        print(f"supervisor: {self.stop}: passing it to rank 0 (pid {targets}) to drain",
              file=sys.stderr, flush=True)
        _kill(targets, signal.SIGTERM)
        return True

    def run(self, env: dict[str, str], keeper: PortKeeper) -> int:
        """Starts torchrun, and again after each failure :meth:`_restarts` allows; returns the
        exit status."""
        why = "starting"
        while True:
            if self.stop:  # before the first start, or between a failure and its restart
                return 128 + int(signal.Signals[self.stop])
            keeper.launched(why)
            # preexec_fn runs before exec only (no threads exist yet in the child)
            self.agent = subprocess.Popen(self.cmd, preexec_fn=_agent_preexec,  # noqa: PLW1509
                                          env=env)
            status = self._wait()
            if self.early is not None:
                return self.early
            if status == 0 or self.stop or not self._restarts(status):
                return status
            why = f"restarting: the job exited {status} after it served"

    def _wait(self) -> int:
        """The agent's exit status (128 + N for signal N), delivering a waiting signal as soon as
        the ranks accept it."""
        assert self.agent is not None
        while True:
            try:
                code = self.agent.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if self.undelivered:
                    self.undelivered = not self.deliver()
        return 128 - code if code < 0 else code

    def _restarts(self, status: int) -> bool:
        """Whether the job that failed with ``status`` starts again: only after it served, and
        at most ``max_restarts`` times within :data:`RESTART_WINDOW_S`; says so either way."""
        assert self.ready is not None
        if not os.path.exists(self.ready):
            print(f"supervisor: the job exited {status} before it served; not restarted "
                  "(a launch failure would repeat)", file=sys.stderr, flush=True)
            return False
        os.remove(self.ready)
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if len(self.restarts) >= self.max_restarts:
            print(f"supervisor: the job exited {status} after it served; "
                  f"{len(self.restarts)} restart(s) within {RESTART_WINDOW_S:g} s already "
                  f"(--max-restarts={self.max_restarts}): giving up", file=sys.stderr,
                  flush=True)
            return False
        self.restarts.append(now)
        print(f"supervisor: the job exited {status} after it served (a rank died?); "
              f"restarting it ({len(self.restarts)} of at most {self.max_restarts} restarts "
              f"within {RESTART_WINDOW_S:g} s); the job store re-queues the job that "
              "was running", file=sys.stderr, flush=True)
        return True
