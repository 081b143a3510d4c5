"""`fasttune export` writes the final cards; `fasttune push` uploads what export made and exports
only what is missing, after checking the repo id, offline mode, the token and the Hub.

The uploads run against the loopback Hub in a subprocess (this file's ``__main__``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from fasttune.export.hub_client import HubPushError
from fasttune.export.manifest import read_manifest, source_fingerprint
from fasttune.run.folder import RunFolder, read_state
from fasttune.run.publish import export_run, push_run
from helpers.fake_run import make_finished_run

TOKEN = "hf_fasttuneTestToken0123456789abcdef"


def test_export_writes_the_final_cards_and_the_modelfile(tmp_path):
    from helpers.hub_card_check import split_card, validate_card

    run = make_finished_run(tmp_path / "run")
    folders = export_run(run, ["adapter", "merged", "gguf"], ["q8_0", "f16"], "float32")
    assert set(folders) == {"adapter", "merged", "gguf"} and set(read_state(run)["artifacts"]) == set(folders)
    source = source_fingerprint(RunFolder(run).final)
    for kind in folders:
        card = (run / kind / "README.md").read_text()
        assert validate_card(card) == ([], []), kind
        assert "[More Information Needed]" not in card and "your-hf-username/demo" in card
        assert "| License | apache-2.0 (random weights built by fasttune, under fasttune's license) |" in card
        assert "| Held-out result | exact match: 87.5%; eval loss: 1.25 |" in card
        assert "fasttune's embedded demo model" in card and "| LoRA rank (r) | 4 |" in card
        assert (run / kind / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
        assert read_manifest(run / kind)["source"] == source
        assert "base_model" not in split_card(card)[0]  # the embedded base has no Hub id
    assert "FROM ./demo-Q8_0.gguf" in (run / "gguf" / "Modelfile").read_text()


def test_push_checks_before_any_work(tmp_path, monkeypatch):
    run = make_finished_run(tmp_path / "run")
    with pytest.raises(ValueError, match="not a valid Hub repo id"):
        push_run(run, "me/bad repo!")
    with pytest.raises(ValueError, match="--repo-id"):
        push_run(run)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(HubPushError, match="HF_HUB_OFFLINE"):
        push_run(run, "me/demo")
    assert time.monotonic() - start < 1.0
    assert not any((run / kind).exists() for kind in ("adapter", "merged", "gguf"))  # nothing exported


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from helpers.hub_subprocess import run_scenarios

    return run_scenarios(__file__, tmp_path_factory.mktemp("publish"), timeout=600)


def test_push_uploads_every_gguf_export_made_and_exports_nothing(report):
    first = report["first"]
    assert first["gguf_local"] == first["gguf_remote"] == report["exported_gguf"]  # none lost, all uploaded
    assert len(report["exported_gguf"]) >= 3
    assert first["weights_untouched"] and not first["exported"]
    assert first["urls"] == ["adapter", "gguf", "merged"]
    card = first["gguf_card"]  # rendered again for the repo pushed to
    assert "your-hf-username" not in card and "ollama run hf.co/tester/demo-GGUF:Q8_0" in card


def test_push_exports_only_a_missing_gguf_type(report):
    second = report["second"]
    assert second["exported"] == ["gguf (GGUF f32)"] and second["others_untouched"]
    assert second["gguf_remote"] == sorted(report["exported_gguf"] + ["demo-F32.gguf"])
    assert report["third_commits"] == report["second_commits"]  # nothing changed: no commit at all


# --- subprocess side -----------------------------------------------------------------------------

def _snapshot(run: Path) -> dict[str, int]:
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for kind in ("adapter", "merged", "gguf")
            for p in (run / kind).glob("*") if p.suffix in (".safetensors", ".gguf")}


def _scenarios(out: Path) -> dict:
    import logging

    from helpers.hub_server import HubServer
    from helpers.hub_subprocess import online_env

    server = HubServer().start()
    online_env(server.url, out)
    exported = []

    class Exports(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("exporting what is not there yet"):
                exported.append(record.getMessage().split(": ", 1)[1])

    logging.getLogger("fasttune.publish").addHandler(Exports())
    logging.getLogger("fasttune.publish").setLevel(logging.INFO)
    try:
        import llama_cpp  # noqa: F401 - K-quants when llama.cpp's quantizer is installed

        quants = ["q8_0", "f16", "q4_0", "q4_k_m"]
    except ImportError:
        quants = ["q8_0", "f16", "q4_0"]
    run = make_finished_run(out / "run")
    export_run(run, ["adapter", "merged", "gguf"], quants, "float32")
    gguf_files = sorted(p.name for p in (run / "gguf").glob("*.gguf"))
    before = _snapshot(run)

    def remote_gguf():
        return sorted(p for p in server.repos["tester/demo-GGUF"].files if p.endswith(".gguf"))

    kw = dict(token=TOKEN)
    urls = push_run(run, "demo", **kw)
    first = {"urls": sorted(urls), "gguf_local": sorted(p.name for p in (run / "gguf").glob("*.gguf")),
             "gguf_remote": remote_gguf(), "weights_untouched": _snapshot(run) == before,
             "exported": list(exported), "gguf_card": server.file_bytes("tester/demo-GGUF", "README.md").decode()}
    exported.clear()
    push_run(run, "tester/demo", gguf_quantizations=["f32"], **kw)
    after = _snapshot(run)
    second = {"exported": list(exported), "gguf_remote": remote_gguf(),
              "others_untouched": all(after[k] == v for k, v in before.items())}
    commits = {r: server.commits(r) for r in server.repos}
    push_run(run, "tester/demo", **kw)
    third = {r: server.commits(r) for r in server.repos}
    server.stop()
    return {"exported_gguf": gguf_files, "first": first, "second": second, "second_commits": commits,
            "third_commits": third}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_lib"))
    from helpers.hub_subprocess import write_report

    out_dir = Path(sys.argv[1])
    write_report(out_dir, _scenarios(out_dir))
