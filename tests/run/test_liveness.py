"""Liveness: a run whose recorded process is gone (killed, crashed, pid reused) reads as interrupted."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from fasttune.run.liveness import describe, effective_status, identity, is_alive, process_gone, start_time


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_identity_names_this_process():
    me = identity()
    assert me["pid"] == os.getpid() and me["host"] == socket.gethostname()
    assert me["pid_start"] == start_time(os.getpid()) and isinstance(me["pid_start"], int)
    assert is_alive(me["pid"], me["pid_start"])


def test_a_killed_process_is_gone_even_before_it_is_reaped():
    proc = _sleeper()
    try:
        state = {"status": "running", "step": 3, "max_steps": 10, **identity(proc.pid)}
        assert not process_gone(state) and effective_status(state) == "running"
        proc.send_signal(signal.SIGKILL)
        for _ in range(200):  # a zombie until waited for: still "gone"
            if process_gone(state):
                break
            time.sleep(0.01)
        assert process_gone(state) and effective_status(state) == "interrupted"
        text = describe(state)
        assert text.startswith("interrupted, step 3/10") and f"process {proc.pid} is gone" in text
    finally:
        proc.kill()
        proc.wait()
    assert effective_status(state) == "interrupted"  # reaped too


def test_a_reused_pid_is_not_the_recorded_process():
    me = identity()
    assert not is_alive(me["pid"], me["pid_start"] + 1)  # same pid, another start time: another process
    assert process_gone({"status": "running", **me, "pid_start": me["pid_start"] + 1})


def test_finished_runs_and_other_hosts_are_taken_as_recorded():
    gone = {"pid": 2 ** 22 + 12345, "pid_start": 1}
    assert effective_status({"status": "completed", **gone}) == "completed"
    assert effective_status({"status": "running", **gone, "host": "another-machine"}) == "running"
    assert effective_status({"status": "running", **gone}) == "interrupted"
    assert effective_status({"status": "running"}) == "running"  # no pid recorded: nothing to judge
    assert describe({"status": "failed", "step": 4}) == "failed, step 4"
