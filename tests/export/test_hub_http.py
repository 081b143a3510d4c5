"""Deadlines on huggingface_hub's requests: a silent server costs one stall timeout, not forever."""

import importlib
import time

import pytest

from fasttune.export.hub_http import current_factory, hub_timeouts
from helpers.black_hole import BlackHole

# The HTTP library huggingface_hub's clients come from: httpx2 on huggingface_hub 2.x, httpx on 1.x.
httpx = importlib.import_module(type(current_factory()()).__module__.split(".")[0])


def test_clients_get_the_deadlines_and_the_old_factory_returns():
    from huggingface_hub.utils import get_session

    before = current_factory()
    with hub_timeouts(connect=2.0, stall=3.0):
        t = get_session().timeout
        assert (t.connect, t.read, t.write, t.pool) == (2.0, 3.0, 3.0, 3.0)
        with hub_timeouts(connect=5.0, stall=1.0):  # nested: the tighter of both
            t = get_session().timeout
            assert (t.connect, t.read) == (2.0, 1.0)
        assert get_session().timeout.read == 3.0
    assert current_factory() is before and get_session().timeout.read is None  # huggingface_hub's own default


def test_a_tighter_user_timeout_is_kept():
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import get_session

    before = current_factory()
    set_client_factory(lambda: httpx.Client(timeout=httpx.Timeout(0.5)))
    try:
        with hub_timeouts(connect=10.0, stall=15.0):
            assert get_session().timeout.read == 0.5
    finally:
        set_client_factory(before)


def test_a_server_that_never_answers_times_out(monkeypatch):
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the test process runs offline
    with BlackHole() as hole, hub_timeouts(connect=1.0, stall=0.5):
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            get_session().get(hole.url + "/api/whoami-v2")
        assert time.monotonic() - start < 3.0 and hole.accepted == 1


def test_bad_deadlines():
    with pytest.raises(ValueError, match="> 0"):
        with hub_timeouts(connect=0, stall=1):
            pass
