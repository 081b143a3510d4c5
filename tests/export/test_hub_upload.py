"""One commit per artifact folder, never two: network faults against the loopback Hub.

Scenarios run in a subprocess (this file's ``__main__``, see helpers/hub_subprocess.py), each on
its own repo with its own injected faults, deadlines of 0.5 s and short back-offs; each reports
whether the upload completed, the commits the server made and how long it took.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

TOKEN = "hf_fasttuneTestToken0123456789abcdef"
CARD = "---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n\n# run\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from helpers.hub_subprocess import run_scenarios

    return run_scenarios(__file__, tmp_path_factory.mktemp("upload"))


def test_clean_upload_stores_every_file(report):
    r = report["clean"]
    assert r["error"] is None and r["commits"] == 1 and r["files_ok"]
    assert r["second_commits"] == 1  # an unchanged folder uploads nothing and commits nothing


def test_a_commit_that_timed_out_and_landed_late_is_not_applied_twice(report):
    r = report["late_commit"]
    assert r["error"] is None and r["files_ok"]
    assert r["commits"] == 1  # the retry landed; the late one was refused (its parent had moved)
    assert sorted(r["commit_statuses"]) == [200, 412], r


def test_a_commit_answered_500_after_landing_is_not_sent_again(report):
    r = report["applied_then_500"]
    assert r["error"] is None and r["commits"] == 1 and r["commit_requests"] == 1 and r["files_ok"]
    assert "the commit landed; not sending it again" in report["log"]


def test_someone_elses_commit_meanwhile_is_kept_and_ours_goes_on_top(report):
    r = report["moved_head"]
    assert r["error"] is None and r["files_ok"] and r["commits"] == 2 and r["other_file_kept"]  # theirs + ours
    assert r["commit_statuses"] == [412, 200]


def test_429_with_retry_after_zero_waits_the_floor(report):
    r = report["rate_limited"]
    assert r["error"] is None and r["files_ok"] and r["commit_statuses"] == [429, 429, 429, 200]
    assert r["seconds"] >= 3 * 0.3  # three waits of at least rate_limit_floor, though Retry-After said 0


@pytest.mark.parametrize("scenario", ["stalled_lfs_put", "stalled_preupload"])
def test_a_stalled_transfer_is_cut_and_retried(report, scenario):
    r = report[scenario]
    assert r["error"] is None and r["files_ok"] and r["commits"] == 1
    assert r["seconds"] < 4.5  # the 3 s stall is cut after 0.5 s, then retried (huggingface_hub waits 1 s)


def test_a_hub_that_never_answers_the_commit_fails_within_the_budget(report):
    r = report["commit_black_hole"]
    assert "commit to tester/hole failed after" in r["error"] and "ReadTimeout" in r["error"]
    assert r["seconds"] < 5.5 and r["commit_requests"] >= 3  # attempts of 0.5 s, total budget 3 s
    # the server acts on the first attempt late; every later one names a parent that has moved
    assert r["commits"] == 1 and sorted(r["commit_statuses"]) == [200] + [412] * (r["commit_requests"] - 1)
    assert TOKEN not in report["log"]


# --- subprocess side -----------------------------------------------------------------------------

def _folder(root: Path, name: str) -> Path:
    import os

    folder = root / name
    folder.mkdir(parents=True)
    (folder / "README.md").write_text(CARD)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(os.urandom(300_000))
    return folder


def _scenarios(out: Path) -> dict:
    from helpers.hub_server import HubServer
    from helpers.hub_subprocess import online_env

    server = HubServer().start()
    online_env(server.url, out)
    from fasttune.export.hub_client import HubClient, HubPushError, RetryPolicy
    from fasttune.export.hub_http import hub_timeouts
    from fasttune.export.hub_upload import upload_folder

    policy = RetryPolicy(attempts=5, base_delay=0.05, call_timeout=0.5, connect_timeout=0.5, total_timeout=3.0,
                         rate_limit_floor=0.3)
    hub = HubClient(TOKEN, policy, out)
    results = {}

    def run(name: str, repo: str, before=None) -> dict:
        folder = _folder(out, name)
        hub.create_repo(repo, private=True)
        start_requests = len(server.requests)
        if before is not None:
            before()
        start = time.monotonic()
        error = None
        with hub_timeouts(policy.connect_timeout, policy.call_timeout):
            try:
                upload_folder(hub, repo, folder, f"upload {name}")
            except HubPushError as e:
                error = str(e)
        seconds = time.monotonic() - start
        server.wait_idle()  # a delayed request the client gave up on still gets handled
        new = server.requests[start_requests:]
        files = server.repos[repo].files
        ok = all(p.name in files and server.file_bytes(repo, p.name) == p.read_bytes() for p in folder.iterdir())
        results[name] = {"error": error, "seconds": seconds, "commits": server.commits(repo), "files_ok": ok,
                         "commit_requests": sum(1 for e, *_ in new if e == "commit"),
                         "commit_statuses": [s for e, _, _, s in new if e == "commit"], "folder": str(folder)}
        return results[name]

    run("clean", "tester/clean")
    with hub_timeouts(policy.connect_timeout, policy.call_timeout):
        upload_folder(hub, "tester/clean", Path(results["clean"]["folder"]), "again")
    results["clean"]["second_commits"] = server.commits("tester/clean")

    run("late_commit", "tester/late", lambda: server.inject("commit", delay=2.0))
    run("applied_then_500", "tester/applied", lambda: server.inject("commit", status=500, apply=True))

    # someone else commits to the repo after our push read its head, while our preupload runs
    run("moved_head", "tester/moved", lambda: server.inject(
        "preupload", before=lambda srv, args: srv.commit_files(args["repo"], {"other.txt": b"someone else's"})))
    results["moved_head"]["other_file_kept"] = "other.txt" in server.repos["tester/moved"].files
    run("rate_limited", "tester/limited", lambda: server.inject("commit", status=429, retry_after="0", times=3))
    run("stalled_lfs_put", "tester/lfs", lambda: server.inject("lfs_put", delay=3.0))
    run("stalled_preupload", "tester/pre", lambda: server.inject("preupload", delay=3.0))
    run("commit_black_hole", "tester/hole", lambda: server.inject("commit", delay=5.0, times=20))
    server.stop()
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))
    from helpers.hub_subprocess import write_report

    out_dir = Path(sys.argv[1])
    write_report(out_dir, _scenarios(out_dir))
