"""Run statistics for the cards, and the loss-curve image (or why there is none)."""

import sys
from types import SimpleNamespace

from fasttune.export.cards import run_stats_from_state, write_loss_curve


def test_run_stats_and_loss_curve(tmp_path, monkeypatch):
    state = SimpleNamespace(global_step=30, log_history=[
        {"loss": 2.0, "step": 10, "tokens_per_second": 100.0, "peak_memory_gib": 3.0},
        {"loss": 1.5, "step": 20, "tokens_per_second": 110.0, "peak_memory_gib": 4.5},
        {"eval_loss": 1.8, "step": 20},
        {"loss": 1.25, "step": 30, "tokens_per_second": 120.0, "peak_memory_gib": 4.0},
        {"train_runtime": 12.5, "train_loss": 1.6, "step": 30}])
    stats = run_stats_from_state(state)
    assert stats == {"global_step": 30, "final_loss": 1.25, "tokens_per_second": 120.0, "peak_memory_gib": 4.5,
                     "train_runtime": 12.5, "loss_curve": [(10, 2.0), (20, 1.5), (30, 1.25)]}
    assert write_loss_curve(stats["loss_curve"], tmp_path / "a.png") is None
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert "fewer than two" in write_loss_curve([(1, 1.0)], tmp_path / "b.png")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert "matplotlib is not installed" in write_loss_curve(stats["loss_curve"], tmp_path / "c.png")
    assert not (tmp_path / "b.png").exists() and not (tmp_path / "c.png").exists()


def test_cards_name_placeholders_until_the_repo_is_known_and_record_what_they_name(tmp_path):
    from fasttune.export.card_facts import CardFacts
    from fasttune.export.cards import card_repos, cards_match, headline_gguf, write_cards

    assert card_repos("me/run", "x", ("merged",)) == ({"merged": "me/run"}, True)
    assert card_repos("run", "x", ("merged", "gguf")) == (
        {"merged": "your-hf-username/run", "gguf": "your-hf-username/run-GGUF"}, False)
    assert card_repos(None, "x", ("adapter",)) == ({"adapter": "your-hf-username/x-lora"}, False)
    folders = {"merged": tmp_path / "merged", "gguf": tmp_path / "gguf"}
    for f in folders.values():
        f.mkdir()
    for name in ("run-F16.gguf", "run-Q4_K_M.gguf", "run-Q8_0.gguf"):
        (tmp_path / "gguf" / name).write_bytes(b"x")
    assert headline_gguf(tmp_path / "gguf").name == "run-Q8_0.gguf"
    repos, published = card_repos(None, "run", folders)
    facts = CardFacts(stats={"global_step": 2, "loss_curve": [(1, 2.0), (2, 1.0)]})
    write_cards(folders, repos, facts=facts, published=published, endpoint="https://hf.example")
    merged = (tmp_path / "merged" / "README.md").read_text()
    assert "Not on the Hub yet" in merged and "ollama run hf.co/your-hf-username/run-GGUF:Q8_0" in merged
    assert (tmp_path / "gguf" / "Modelfile").read_text().count("FROM ./run-Q8_0.gguf") == 1
    assert (tmp_path / "merged" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not cards_match(folders, repos)  # placeholders: a push renders them again
    real = {"merged": "me/run", "gguf": "me/run-GGUF"}
    write_cards(folders, real, facts=facts, endpoint="https://hf.example")
    assert cards_match(folders, real) and not cards_match(folders, {"merged": "me/other", "gguf": "me/other-GGUF"})


def test_gguf_card_lists_a_vlm_mmproj_apart_from_the_model_files(tmp_path):
    from fasttune.export.cards import headline_gguf, write_cards

    folder = tmp_path / "gguf"
    folder.mkdir()
    for name in ("vlm-Q8_0.gguf", "mmproj-vlm-F16.gguf"):
        (folder / name).write_bytes(b"x")
    assert headline_gguf(folder).name == "vlm-Q8_0.gguf"
    write_cards({"gguf": folder}, {"gguf": "me/vlm-GGUF"}, endpoint="https://hf.example")
    card = (folder / "README.md").read_text()
    assert "| vision tower + projector (mmproj) |" in card and "--mmproj mmproj-vlm-F16.gguf" in card
    assert (folder / "Modelfile").read_text().count("FROM ./vlm-Q8_0.gguf") == 1
