# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C: nothing the project prints on the way out is a traceback.

A terminal's Ctrl-C sends SIGINT to every process of the foreground group: the supervisor (or
torchrun's agent) and every rank. The tests send it the same way (``killpg``), once the server
serves and while its ranks still start. torchrun's own agent re-raises the signal with its own
traceback (``SignalException``, torch's behaviour, which the README explains); the supervisor form
(``launch/serve.py --nproc-per-node N``) is the one that stops with exit status 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, free_port, subprocess_env
from tests.serve._server import SERVE, STARTUP_S, Server, torchrun

FLAGS = ("--video-runner", "synthetic")
#: A traceback through the project's own code (torchrun's agent has none of these frames).
OURS = re.compile(r'File "[^"]*(dist_attn/|launch/serve\.py)')


def _start(cmd: list[str], tmp_path) -> Server:
    port = free_port()
    log_path = str(tmp_path / "ctrl-c.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*cmd, "--port", str(port), "--output-dir", str(tmp_path / "out"), *FLAGS],
                                cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Server(proc, port, log_path)


def _wait_for(srv: Server, needle: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while needle not in srv.log():
        assert srv.proc.poll() is None and time.monotonic() < deadline, srv.log()[-3000:]
        time.sleep(0.05)


def _ctrl_c(srv: Server) -> tuple[int, str]:
    """SIGINT to the whole process group, as a terminal's Ctrl-C; (exit status, output)."""
    os.killpg(srv.proc.pid, signal.SIGINT)
    try:
        code = srv.proc.wait(timeout=60)
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
    return code, srv.log()


def test_ctrl_c_on_the_supervised_server_drains_and_exits_0(tmp_path):
    srv = _start([sys.executable, SERVE, "--nproc-per-node", "2"], tmp_path)
    try:
        srv.wait_healthy()
        code, log = _ctrl_c(srv)
    finally:
        srv.kill()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    assert "[rank 0] INFO dist_attn.models.h3.serve.ranks.loop: shut down cleanly" in log, log[-3000:]


@pytest.mark.parametrize("form", ["supervisor", "torchrun"])
def test_ctrl_c_while_the_ranks_start_prints_no_traceback_of_ours(tmp_path, form):
    """A rank interrupted in its start-up printed a KeyboardInterrupt traceback, and its peers a
    gloo 'Connection closed by peer' one; under the supervisor the agent added its
    ChildFailedError. Now: one line from rank 0 (torchrun) or from the supervisor, which ends a
    launch that does not serve yet at once."""
    cmd = [sys.executable, SERVE, "--nproc-per-node", "2"] if form == "supervisor" else torchrun(2)
    srv = _start(cmd, tmp_path)
    try:
        _wait_for(srv, "[rank 0] INFO dist_attn.distributed: process-group backend")  # still starting
        code, log = _ctrl_c(srv)
    finally:
        srv.kill()
    assert not OURS.search(log), log[-4000:]
    if form == "supervisor":
        # the launch was usually still starting (130), or had just begun serving (a drain: 0)
        assert code in (0, 130) and "Traceback" not in log, (code, log[-3000:])
        if code == 130:
            assert "supervisor: SIGINT before the server was up: ending the launch" in log, log[-3000:]
    else:
        assert code != 0 or "shut down cleanly" in log, log[-3000:]


def test_an_error_after_a_stop_signal_ends_the_rank_with_one_line(monkeypatch, capsys):
    """cli.run: an exception while the ranks stop (a peer gone after the same Ctrl-C) is one line
    on rank 0 and 128 + the signal; the same exception with no stop signal is a fault: raised."""
    from dist_attn.models.h3.serve.launch import cli
    from dist_attn.models.h3.serve.ranks import lifecycle

    def fails():
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(cli, "main", fails)
    monkeypatch.setattr(lifecycle, "_STOPS", [])
    for var in ("RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        cli.run()
    monkeypatch.setattr(lifecycle, "_STOPS", [signal.SIGINT])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == 130
    assert capsys.readouterr().err == ("launch/serve.py: error: stopped by SIGINT (RuntimeError as "
                                       "the ranks stopped)\n")
