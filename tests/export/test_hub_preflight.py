"""A push checks the repo id, offline mode, the token and the Hub before any work.

The offline and repo-id checks run here (the test process is offline); token and reachability run
against loopback servers in a subprocess (this file's ``__main__``): a Hub that rejects the token,
one that says it is read-only, a Hub that answers 500, and one that accepts connections and never
answers. Each scenario reports how long the push took to fail.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from fasttune.export.hub_client import HubPushError
from fasttune.export.hub_preflight import check_online, check_repo_id

TOKEN = "hf_fasttuneTestToken0123456789abcdef"


@pytest.mark.parametrize("repo_id, why", [
    ("me/bad repo!", "alphanumeric"), ("a/b/c", "namespace/repo_name"), ("", "'name' or 'namespace/name'"),
    ("me/" + "x" * 94, "the lora repo"), (None, "'name' or 'namespace/name'")])
def test_invalid_repo_ids_are_refused(repo_id, why):
    with pytest.raises(ValueError, match="repo_id") as info:
        check_repo_id(repo_id)
    assert why in str(info.value)
    check_repo_id("me/fine-name.v2")


def test_offline_fails_at_once_and_exports_nothing(tmp_path, monkeypatch):
    from fasttune.export.hub import push_to_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubPushError, match="HF_HUB_OFFLINE .* is set"):
        check_online()
    start = time.monotonic()
    with pytest.raises(HubPushError, match="Nothing was exported or uploaded"):
        push_to_hub(object(), None, "me/run", output_dir=tmp_path / "out")  # the model is never touched
    assert time.monotonic() - start < 1.0
    with pytest.raises(ValueError, match="not a valid Hub repo id"):  # the repo id is checked even before
        push_to_hub(object(), None, "me/bad repo!", output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from helpers.hub_subprocess import run_scenarios

    return run_scenarios(__file__, tmp_path_factory.mktemp("preflight"))


def test_a_good_token_gives_the_namespace(report):
    assert report["ok"] == {"repo": "tester/run", "error": None}
    assert report["named"]["repo"] == "org/run"


@pytest.mark.parametrize("scenario, message, status", [
    ("no_token", "no Hub token: set HF_TOKEN", None),
    ("bad_token", "rejected the token (401)", 401),
    ("read_only", "the token is read-only", 403),
    ("server_error", "cannot reach the Hub at http://127.0.0.1:", 500),
    ("black_hole", "cannot reach the Hub at http://127.0.0.1:", None)])
def test_token_and_hub_problems_fail_before_any_work(report, scenario, message, status):
    result = report[scenario]
    assert message in result["error"] and result["status"] == status, result
    assert TOKEN not in result["error"] and TOKEN not in report["log"]
    assert result["seconds"] < 10  # within the scenario's deadlines (stall 0.5 s, 3 whoami attempts)


def test_a_silent_hub_is_given_up_after_the_deadlines(report):
    hole = report["black_hole"]
    assert hole["connections"] == 3  # one per whoami attempt, each ended by the 0.5 s stall deadline
    assert 1.4 <= hole["seconds"] < 6


# --- subprocess side -----------------------------------------------------------------------------

def _scenarios(out: Path) -> dict:
    import os

    from helpers.black_hole import BlackHole
    from helpers.hub_server import HubServer
    from helpers.hub_subprocess import online_env

    with HubServer(tokens={TOKEN}) as hub, HubServer(tokens={TOKEN}, role="read") as read_only, \
            HubServer(user="org") as named, BlackHole() as hole:
        online_env(hub.url, out)
        from fasttune.export.hub import push_session
        from fasttune.export.hub_client import RetryPolicy

        policy = RetryPolicy(attempts=5, base_delay=0.01, call_timeout=0.5, connect_timeout=0.5)

        def attempt(endpoint, token, repo="run"):
            start = time.monotonic()
            try:
                with push_session(repo, token, policy, out, endpoint=endpoint) as (_, full):
                    return {"repo": full, "error": None, "seconds": time.monotonic() - start}
            except HubPushError as e:
                return {"repo": None, "error": str(e), "status": e.status_code, "seconds": time.monotonic() - start}

        results = {"ok": attempt(hub.url, TOKEN), "named": attempt(named.url, TOKEN),
                   "bad_token": attempt(hub.url, "hf_wrongToken0123"), "read_only": attempt(read_only.url, TOKEN)}
        results["ok"] = {k: results["ok"][k] for k in ("repo", "error")}
        os.environ["HF_HOME"] = str(out / "empty_home")  # no stored token either
        results["no_token"] = attempt(hub.url, None)
        hub.inject("whoami", status=500, times=10)
        results["server_error"] = attempt(hub.url, TOKEN)
        results["black_hole"] = attempt(hole.url, TOKEN)
        results["black_hole"]["connections"] = hole.accepted
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))
    from helpers.hub_subprocess import write_report

    out_dir = Path(sys.argv[1])
    write_report(out_dir, _scenarios(out_dir))
