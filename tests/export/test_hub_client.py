"""Hub calls: a rejected call is not retried and its message holds no token; back-off has a floor
and a time budget."""

from types import SimpleNamespace

import pytest

from fasttune.export import hub_client
from fasttune.export.hub_client import HubClient, HubPushError, RetryPolicy

TOKEN = "hf_fasttuneTestToken0123456789abcdef"


def _failing(status, calls, headers=None):
    def call():
        calls.append(status)
        err = RuntimeError(f"HTTP {status} for Authorization: Bearer {TOKEN}")
        err.response = SimpleNamespace(status_code=status, headers=headers or {})
        raise err
    return call


def test_rejected_call_is_not_retried_and_scrubbed(tmp_path):
    hub = HubClient(TOKEN, RetryPolicy(attempts=4, base_delay=0.0, rate_limit_floor=0.0), tmp_path)
    calls = []
    with pytest.raises(HubPushError) as info:
        hub.call("create_repo x", _failing(403, calls))
    assert calls == [403] and info.value.status_code == 403
    assert TOKEN not in str(info.value) and "Bearer ***" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    calls.clear()
    with pytest.raises(HubPushError):
        hub.call("commit", _failing(503, calls))
    assert calls == [503] * 4
    flaky = iter([_failing(500, calls), _failing(429, calls), lambda: "ok"])
    assert hub.call("commit", lambda: next(flaky)()) == "ok"


def test_429_back_off_has_a_floor_and_honours_a_longer_retry_after(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(hub_client.time, "sleep", slept.append)
    hub = HubClient(TOKEN, RetryPolicy(attempts=5, base_delay=0.01, rate_limit_floor=1.0), tmp_path)
    calls = []
    with pytest.raises(HubPushError, match="after 5 attempt"):
        hub.call("commit", _failing(429, calls, {"Retry-After": "0"}))
    assert slept == [1.0, 1.0, 1.0, 1.0]  # Retry-After: 0 does not burn the attempts in no time
    slept.clear()
    with pytest.raises(HubPushError):
        hub.call("commit", _failing(429, calls, {"Retry-After": "7"}))
    assert slept == [7.0] * 4
    slept.clear()
    with pytest.raises(HubPushError):
        hub.call("commit", _failing(503, calls))
    assert slept == [0.01, 0.02, 0.04, 0.08]  # other failures: plain exponential back-off


def test_retries_stop_at_the_time_budget(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(hub_client.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hub_client.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    hub = HubClient(TOKEN, RetryPolicy(attempts=10, base_delay=4.0, max_delay=30.0, total_timeout=20.0), tmp_path)
    calls = []
    with pytest.raises(HubPushError, match=r"commit failed after 3 attempt\(s\) within 20 s"):
        hub.call("commit", _failing(502, calls))
    assert len(calls) == 3 and clock[0] == 12.0  # 4 + 8 s slept; a 16 s wait would pass the budget


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="call_timeout"):
        RetryPolicy(call_timeout=0)


def test_an_attempt_that_would_end_past_the_budget_is_not_started(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(hub_client.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hub_client.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    hub = HubClient(TOKEN, RetryPolicy(attempts=5, base_delay=1.0, total_timeout=120.0), tmp_path)

    def stalled():  # huggingface_hub's own retries of a stalled preupload: 6 x 15 s + 23 s of back-off
        clock[0] += 113.0
        raise TimeoutError("timed out")

    with pytest.raises(HubPushError, match="within 120 s"):
        hub.call("upload to me/x", stalled)
    assert clock[0] == 113.0  # not 227 s: a second attempt could not end in time
