"""Hub calls: a rejected call is not retried and its message holds no token; a hang becomes a retry."""

import time
from types import SimpleNamespace

import pytest

from fasttune.export.hub_client import HubClient, HubPushError, RetryPolicy

TOKEN = "hf_fasttuneTestToken0123456789abcdef"


def test_rejected_call_is_not_retried_and_scrubbed(tmp_path):
    hub = HubClient(TOKEN, RetryPolicy(attempts=4, base_delay=0.0, call_timeout=5.0), tmp_path)
    calls = []

    def fail(status):
        def call():
            calls.append(status)
            err = RuntimeError(f"HTTP {status} for Authorization: Bearer {TOKEN}")
            err.response = SimpleNamespace(status_code=status, headers={})
            raise err
        return call

    with pytest.raises(HubPushError) as info:
        hub.call("create_repo x", fail(403))
    assert calls == [403] and info.value.status_code == 403
    assert TOKEN not in str(info.value) and "Bearer ***" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    calls.clear()
    with pytest.raises(HubPushError):
        hub.call("commit", fail(503))
    assert calls == [503] * 4
    flaky = iter([fail(500), fail(429), lambda: "ok"])
    assert hub.call("commit", lambda: next(flaky)()) == "ok"


def test_deadline_turns_a_hang_into_a_retry(tmp_path):
    hub = HubClient(TOKEN, RetryPolicy(attempts=3, base_delay=0.0, call_timeout=0.3), tmp_path)
    answers = iter([lambda: time.sleep(2.0), lambda: "done"])
    start = time.monotonic()
    assert hub.call("commit", lambda: next(answers)()) == "done"
    assert time.monotonic() - start < 1.5
