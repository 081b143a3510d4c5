"""Hub uploads against a loopback Hub (tests/_lib/helpers/hub_server.py) with injected faults.

huggingface_hub reads HF_ENDPOINT when it is imported, so each push runs in a subprocess: this
file, executed as a script with a scenario name (see the bottom). The parent starts the server,
queues faults, runs the scenario and checks what the server stored, the cards, the hashes and
that the token appears nowhere (stored files, local artifacts, logs, exception messages).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOKEN = "hf_fasttuneTestToken0123456789abcdef"
REPO_ROOT = Path(__file__).resolve().parents[2]


# --- parent side ---------------------------------------------------------------------------------

def _run(server, scenario: str, tmp_path: Path, timeout: int = 300) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_ENDPOINT=server.url, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf_home"),
               HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests" / "_lib")]))
    proc = subprocess.run([sys.executable, __file__, scenario, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    report["log"] = log
    return report


def _front_matter(text: str) -> dict:
    import yaml

    assert text.startswith("---\n")
    return yaml.safe_load(text[4:].split("\n---\n", 1)[0])


def _assert_token_nowhere(server, report, *folders):
    assert TOKEN in server.tokens_seen  # it was used...
    for label, data in server.all_stored_bytes():  # ...but never stored,
        assert TOKEN.encode() not in data, label
    for folder in folders:  # written locally,
        for p in Path(folder).rglob("*"):
            if p.is_file():
                assert TOKEN.encode() not in p.read_bytes(), p
    assert TOKEN not in report["log"]  # or logged / raised


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def server():
    from helpers.hub_server import HubServer

    with HubServer() as srv:
        yield srv


def test_full_push_after_training(server, tmp_path):
    report = _run(server, "full", tmp_path)
    base = f"{server.url}/tester/tiny-sft"
    assert report["urls"] == {"merged": base, "gguf": base + "-GGUF", "adapter": base + "-lora"}
    repos = {k: r for k, r in server.repos.items() if k != "org/tiny-base"}
    assert set(repos) == {"tester/tiny-sft", "tester/tiny-sft-lora", "tester/tiny-sft-GGUF"}
    assert all(r.private for r in repos.values())
    files = {k: set(r.files) for k, r in repos.items()}
    assert {"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "loss_curve.png"} <= files["tester/tiny-sft"]
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "loss_curve.png"} <= files["tester/tiny-sft-lora"]
    assert files["tester/tiny-sft-GGUF"] == {"README.md", "Modelfile", "loss_curve.png", "tiny-sft-Q8_0.gguf",
                                              "tiny-sft-F16.gguf"}
    # stored bytes = local artifacts (sha256 for LFS objects), downloads round-trip
    out = Path(report["output_dir"])
    for repo_id, folder in (("tester/tiny-sft", "merged"), ("tester/tiny-sft-lora", "adapter"),
                            ("tester/tiny-sft-GGUF", "gguf")):
        for path, f in repos[repo_id].files.items():
            local = out / folder / path
            assert hashlib.sha256(server.file_bytes(repo_id, path)).hexdigest() == _sha256(local), path
            if path.endswith((".safetensors", ".gguf", ".png")):
                assert f.lfs_oid == _sha256(local)
    assert server.file_bytes("tester/tiny-sft-GGUF", "loss_curve.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["merged_logits_diff"] <= 1e-5 and report["adapter_logits_diff"] <= 1e-5
    assert report["gguf_arch"] == "llama" and report["listed"] == sorted(files["tester/tiny-sft-GGUF"])
    # cards: conventions, cross links, stats, config without secrets
    merged = _front_matter(server.file_bytes("tester/tiny-sft", "README.md").decode())
    adapter = _front_matter(server.file_bytes("tester/tiny-sft-lora", "README.md").decode())
    gguf_card_text = server.file_bytes("tester/tiny-sft-GGUF", "README.md").decode()
    gguf_card = _front_matter(gguf_card_text)
    assert merged["library_name"] == "transformers" and merged["base_model"] == "org/tiny-base"
    assert adapter["library_name"] == "peft" and "base_model:adapter:org/tiny-base" in adapter["tags"]
    assert gguf_card["base_model"] == "tester/tiny-sft" and gguf_card["base_model_relation"] == "quantized"
    assert "ollama run hf.co/tester/tiny-sft-GGUF:Q8_0" in gguf_card_text
    assert f"({server.url}/tester/tiny-sft-lora)" in gguf_card_text
    assert "| 3 |" in gguf_card_text and "4,321" in gguf_card_text  # steps and the logged tokens/s
    adapter_cfg = json.loads(server.file_bytes("tester/tiny-sft-lora", "adapter_config.json"))
    assert adapter_cfg["base_model_name_or_path"] == "org/tiny-base"
    modelfile = server.file_bytes("tester/tiny-sft-GGUF", "Modelfile").decode()
    assert "FROM ./tiny-sft-Q8_0.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "| push_to_hub | true |" in gguf_card_text and "hub_token" not in gguf_card_text
    # the base's license (from its card on the Hub), hyperparameters as a table, no local path
    for card in (merged, adapter, gguf_card):
        assert card["license"] == "llama3.2"
    assert "| LoRA rank (r) | 4 |" in gguf_card_text and "| learning rate | 0.001 |" in gguf_card_text
    assert "/local/checkpoints" not in gguf_card_text
    # every README passed the server's validation, huggingface_hub's ModelCard.validate and renders
    checked = [errors for text, errors in server.card_checks if "fasttune" in text]
    assert len(checked) >= 3 and not any(checked)
    assert report["validated"] == ["tester/tiny-sft", "tester/tiny-sft-GGUF", "tester/tiny-sft-lora"]
    assert report["invalid_card"].count("not a valid repo id") == 1 and "not a license id" in report["invalid_card"]
    for repo, page in report["pages"].items():
        assert page["tables"] >= 3 and page["png"], (repo, page)
    _assert_token_nowhere(server, report, out)


def test_transient_faults_are_retried(server, tmp_path):
    server.inject("whoami", status=500)
    server.inject("create_repo", status=429)
    server.inject("create_repo", status=503, echo_auth=True)
    server.inject("validate_yaml", status=500)
    server.inject("preupload", status=500)
    server.inject("lfs_put", drop=True)  # connection dropped mid-upload
    server.inject("commit", status=500)
    server.inject("commit", drop=True)
    server.inject("commit", delay=4.0)  # beyond the 1.5 s call timeout of the scenario
    server.inject("model_info", status=502)
    report = _run(server, "faults", tmp_path)
    assert server.pending_faults() == {}
    assert set(report["urls"]) == {"adapter", "gguf"}
    assert {"adapter_model.safetensors", "README.md"} <= set(server.repos["tester/faulty-lora"].files)
    assert "faulty-Q8_0.gguf" in server.repos["tester/faulty-GGUF"].files
    for endpoint, status in (("create_repo", 429), ("create_repo", 503), ("validate_yaml", 500),
                             ("commit", 500), ("model_info", 502), ("whoami", 500)):
        assert server.count(endpoint, status) == 1, (endpoint, status)
    assert server.count("lfs_put", -1) == 1 and server.count("commit", -1) == 1
    server.wait_idle()
    assert server.commits("tester/faulty-lora") == 1 and server.commits("tester/faulty-GGUF") == 1  # never twice
    assert "Bearer ***" in report["log"]  # the server echoed the header; the client scrubbed it
    _assert_token_nowhere(server, report, report["output_dir"])


def test_failed_push_keeps_artifacts_and_rerun_completes(server, tmp_path):
    server.inject("commit", status=500, times=3)  # exhausts the 3 attempts of the first push
    report = _run(server, "rerun", tmp_path)
    first = report["first"]
    assert first["error"] == "HubPushError" and first["status_code"] == 500
    assert "commit to tester/resume" in first["message"] and report["output_dir"] in first["message"]
    assert first["local_files_ok"]
    # the rerun uploaded nothing twice (each LFS object PUT once) and re-saved identical files (no stray objects)
    assert server.lfs_puts and all(n == 1 for n in server.lfs_puts.values())
    assert set(server.lfs_puts) == {f.lfs_oid for r in server.repos.values() for f in r.files.values() if f.lfs_oid}
    merged = server.repos["tester/resume"]
    assert {"model.safetensors", "config.json", "README.md"} <= set(merged.files)
    assert report["second"]["urls"]["merged"].endswith("/tester/resume")
    # a third run with nothing changed makes no new commit
    assert report["commits_after_second"] == report["commits_after_third"]
    _assert_token_nowhere(server, report, report["output_dir"])


def test_push_argument_errors():
    from fasttune.export.hub import push_to_hub

    with pytest.raises(ValueError, match="artifacts"):
        push_to_hub(None, None, "me/x", artifacts=("weights",))
    with pytest.raises(ValueError, match="repo_id"):
        push_to_hub(None, None, "a/b/c")


# --- subprocess side -----------------------------------------------------------------------------

def _tiny_peft():
    import torch
    from peft import LoraConfig, get_peft_model

    from helpers.tiny_models import tiny_model
    from helpers.tiny_tokenizers import bpe_tokenizer

    tok = bpe_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, head_dim=16)
    model.config._name_or_path = "/local/checkpoints/tiny-base"  # a local path must not reach the cards
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    return peft_model, tok


def _logits(model, ids):
    import torch

    model.eval()
    with torch.no_grad():
        return model(ids).logits.float()


def _scenario_full(out: Path) -> dict:
    import torch
    from huggingface_hub import HfApi, snapshot_download
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import gguf
    from fasttune.config import FastConfig
    from fasttune.hf_integration.train_end import export_after_training
    from helpers.tiny_models import tiny_model

    peft_model, tok = _tiny_peft()

    class LoggingTrainer(Trainer):  # what FastTrainer adds to each log line
        def log(self, logs, *args, **kwargs):
            if "loss" in logs:
                logs = {**logs, "tokens_per_second": 4321.0, "peak_memory_gib": 0.25}
            return super().log(logs, *args, **kwargs)

    from huggingface_hub import CommitOperationAdd, ModelCard

    api = HfApi()  # the base model's card, where the license comes from
    api.create_repo("org/tiny-base", token=TOKEN, exist_ok=True)
    api.create_commit("org/tiny-base", [CommitOperationAdd("README.md", b"---\nlicense: llama3.2\n---\n# base\n")],
                      commit_message="card", token=TOKEN)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, len(tok), (6, 16), generator=g)]
    args = TrainingArguments(output_dir=str(out / "run"), max_steps=3, per_device_train_batch_size=2,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                             learning_rate=1e-3, hub_token=TOKEN, disable_tqdm=True)
    trainer = LoggingTrainer(model=peft_model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    cfg = FastConfig(push_to_hub=True, hub_model_id="tiny-sft", gguf_quantizations=("q8_0", "f16"),
                     base_model_id="org/tiny-base", merged_dtype="float32")
    result = export_after_training(trainer, cfg)

    ids = torch.randint(0, len(tok), (1, 9), generator=g)
    ref = _logits(peft_model, ids)
    merged_dir = snapshot_download("tester/tiny-sft", token=TOKEN, cache_dir=str(out / "dl"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, attn_implementation="eager")
    adapter_dir = snapshot_download("tester/tiny-sft-lora", token=TOKEN, cache_dir=str(out / "dl"))
    base = tiny_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, head_dim=16)
    adapter = PeftModel.from_pretrained(base, adapter_dir)
    gguf_dir = snapshot_download("tester/tiny-sft-GGUF", token=TOKEN, cache_dir=str(out / "dl"))
    reader = gguf.GGUFReader(str(Path(gguf_dir) / "tiny-sft-Q8_0.gguf"))
    import re
    import urllib.request

    validated, pages = [], {}
    for repo in sorted(result["urls"].values()):
        repo_id = repo.split("/", 3)[-1]
        card = ModelCard.load(repo_id, token=TOKEN)
        card.validate()  # huggingface_hub's own check, answered by the loopback's validate-yaml
        validated.append(repo_id)
        html = urllib.request.urlopen(repo).read().decode()
        img = re.search(r'<img src="([^"]+)"', html)
        png = urllib.request.urlopen(img.group(1)).read()[:8] == b"\x89PNG\r\n\x1a\n" if img else False
        pages[repo_id] = {"tables": html.count("<table>"), "png": png}
    try:
        ModelCard("---\nbase_model: /local/checkpoints/x\nlicense: not-a-license\n---\n# x\n").validate()
        invalid = "accepted"
    except ValueError as e:
        invalid = str(e)
    return {"urls": result["urls"], "output_dir": str(out / "run"), "validated": validated, "pages": pages,
            "invalid_card": invalid,
            "merged_logits_diff": float((_logits(merged, ids) - ref).abs().max()),
            "adapter_logits_diff": float((_logits(adapter, ids) - ref).abs().max()),
            "gguf_arch": reader.fields["general.architecture"].contents(),
            "listed": sorted(HfApi().list_repo_files("tester/tiny-sft-GGUF", token=TOKEN))}


def _scenario_faults(out: Path) -> dict:
    from fasttune.export.hub import RetryPolicy, push_to_hub

    model, tok = _tiny_peft()
    urls = push_to_hub(model, tok, "faulty", artifacts=("adapter", "gguf"), token=TOKEN, output_dir=out / "art",
                       retry=RetryPolicy(attempts=6, base_delay=0.05, call_timeout=1.5))
    return {"urls": urls, "output_dir": str(out / "art")}


def _scenario_rerun(out: Path) -> dict:
    from safetensors.torch import load_file

    from fasttune.export.hub import HubPushError, RetryPolicy, push_to_hub

    model, tok = _tiny_peft()
    art = out / "art"
    kwargs = dict(artifacts=("merged", "adapter"), token=TOKEN, output_dir=art, merged_dtype="float32",
                  retry=RetryPolicy(attempts=3, base_delay=0.05, call_timeout=5.0))
    first = {}
    try:
        push_to_hub(model, tok, "tester/resume", **kwargs)
        first["error"] = None
    except HubPushError as e:
        first.update(error=type(e).__name__, message=str(e), status_code=e.status_code)
        load_file(str(art / "merged" / "model.safetensors"))
        load_file(str(art / "adapter" / "adapter_model.safetensors"))
        first["local_files_ok"] = all((art / k / "README.md").is_file() for k in ("merged", "adapter"))
    from helpers.hub_server import HubServer  # noqa: F401 - only to show the helper is importable here
    second = {"urls": push_to_hub(model, tok, "tester/resume", **kwargs)}
    from huggingface_hub import HfApi

    api = HfApi()
    shas = lambda: {r: api.model_info(r, token=TOKEN).sha for r in ("tester/resume", "tester/resume-lora")}  # noqa: E731
    after_second = shas()
    push_to_hub(model, tok, "tester/resume", **kwargs)
    return {"first": first, "second": second, "output_dir": str(art), "commits_after_second": after_second,
            "commits_after_third": shas()}


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    fn = {"full": _scenario_full, "faults": _scenario_faults, "rerun": _scenario_rerun}[scenario]
    (out_dir / "report.json").write_text(json.dumps(fn(out_dir)))
