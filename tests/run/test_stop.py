"""SIGTERM/SIGINT: inside the training loop at the end of the step, outside it at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fasttune.run.stop import StopRequested, StopSignal


def test_stop_signal_stops_at_step_end_inside_the_loop_and_at_once_outside():
    stop = StopSignal().install()
    try:
        stop.in_loop = True
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
        stop.in_loop = False
        with pytest.raises(StopRequested):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs between bytecodes of this thread
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle
