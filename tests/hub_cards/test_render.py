"""Model cards and the Ollama Modelfile: front matter per Hub conventions, links, stats, no secrets."""

import json
import sys

import pytest
import yaml

from fasttune.hub_cards import CARD_KINDS, detect_chat_format, render_card

REPOS = {"adapter": "me/run-lora", "merged": "me/run", "gguf": "me/run-GGUF"}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}")


def _ctx(**over):
    ctx = dict(
        repos=dict(REPOS), base_model_id="org/Base-1B", datasets=["trl-lib/Capybara", "org/data: with colon"],
        stats={"global_step": 1234, "final_loss": 1.23456789, "tokens_per_second": 6543.21, "peak_memory_gib": 7.5,
               "train_runtime": 98.7},
        loss_curve="loss_curve.png",
        fast_config={"checkpointing": "offload", "push_to_hub": True, "hub_model_id": "me/run", "hub_token": "hf_x",
                     "nested": {"api_key": "k", "ok": 1}},
        gguf_files=[{"file": "run-Q8_0.gguf", "quant": "Q8_0", "size": "1.0 GiB"},
                    {"file": "run-Q4_K_M.gguf", "quant": "Q4_K_M", "size": "600.0 MiB"}],
        chat_template=CHATML, modelfile_gguf="run-Q8_0.gguf", endpoint="https://huggingface.co/")
    ctx.update(over)
    return ctx


def _front_matter(text):
    assert text.startswith("---\n"), text[:80]
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def _render(kind, **over):
    ctx = _ctx(**over)
    ctx.setdefault("repo_id", REPOS.get(kind, "me/run-GGUF"))
    return render_card(kind, **ctx)


def test_adapter_card_front_matter_and_usage():
    meta, body = _front_matter(_render("adapter"))
    assert meta["library_name"] == "peft"
    assert meta["base_model"] == "org/Base-1B"
    assert "lora" in meta["tags"] and "base_model:adapter:org/Base-1B" in meta["tags"]
    assert meta["datasets"] == ["trl-lib/Capybara", "org/data: with colon"]
    assert meta["pipeline_tag"] == "text-generation"
    assert 'AutoPeftModelForCausalLM.from_pretrained("me/run-lora")' in body
    assert 'PeftModel.from_pretrained(base, "me/run-lora")' in body


def test_merged_card_front_matter():
    meta, body = _front_matter(_render("merged"))
    assert meta["library_name"] == "transformers"
    assert meta["base_model"] == "org/Base-1B" and meta["base_model_relation"] == "finetune"
    assert 'AutoModelForCausalLM.from_pretrained("me/run"' in body


def test_gguf_card_quantized_relation_files_and_ollama():
    meta, body = _front_matter(_render("gguf"))
    assert meta["base_model"] == "me/run" and meta["base_model_relation"] == "quantized"
    assert {"gguf", "llama.cpp"} <= set(meta["tags"])
    assert "ollama run hf.co/me/run-GGUF:Q8_0" in body
    assert "llama-cli -hf me/run-GGUF:Q8_0" in body
    assert "run-Q4_K_M.gguf" in body and "| Q4_K_M |" in body


def test_gguf_card_without_merged_repo_is_a_finetune_of_the_base():
    meta, _ = _front_matter(_render("gguf", repos={"gguf": "me/run-GGUF"}))
    assert meta["base_model"] == "org/Base-1B" and meta["base_model_relation"] == "finetune"


@pytest.mark.parametrize("kind", ["adapter", "merged", "gguf"])
def test_cards_without_base_model_have_no_base_model_key(kind):
    meta, _ = _front_matter(_render(kind, base_model_id=None, repos={kind: REPOS[kind]}))
    assert "base_model" not in meta
    assert not any(t.startswith("base_model:") for t in meta["tags"])


@pytest.mark.parametrize("kind", ["adapter", "merged", "gguf"])
def test_cards_link_each_other_and_show_stats(kind):
    _, body = _front_matter(_render(kind))
    for other, repo in REPOS.items():
        if other != kind:
            assert f"(https://huggingface.co/{repo})" in body
    assert "(this repo)" in body
    assert "| 1,234 | 1.235 | 6,543 | 7.5 | 98.7 |" in body
    assert "![training loss](loss_curve.png)" in body
    assert "[trl-lib/Capybara](https://huggingface.co/datasets/trl-lib/Capybara)" in body


def test_card_embeds_config_as_a_table_without_secrets():
    text = _render("merged")
    block = text.split("<summary>fasttune configuration</summary>", 1)[1].split("</details>", 1)[0]
    rows = dict(line.strip("|").split(" | ", 1) for line in block.strip().splitlines()[2:])
    config = {k.strip(): v.strip() for k, v in rows.items()}
    assert config["checkpointing"] == "offload" and json.loads(config["nested"]) == {"ok": 1}
    assert config["push_to_hub"] == "true"
    assert "hub_token" not in config and "hf_x" not in text and "api_key" not in text


@pytest.mark.parametrize("kind", ["adapter", "merged", "gguf"])
def test_fp8_training_is_named_on_every_card(kind):
    from fasttune import FastConfig

    plain = _render(kind, fast_config=FastConfig().to_dict())
    fp8 = _render(kind, fast_config=FastConfig(base_dtype="fp8").to_dict())
    assert "FP8" not in plain
    assert "Trained with FP8 base matmuls" in fp8 and "original 16-bit base weights" in fp8


def test_missing_loss_curve_note():
    _, body = _front_matter(_render("adapter", loss_curve=None,
                                    loss_curve_note="Loss curve not shown: matplotlib is not installed."))
    assert "![training loss]" not in body
    assert "_Loss curve not shown: matplotlib is not installed._" in body


@pytest.mark.parametrize("template, fmt, stop", [
    (CHATML, "chatml", "<|im_end|>"),
    ("{{ '<|start_header_id|>' + r + '<|end_header_id|>' + c + '<|eot_id|>' }}", "llama3", "<|eot_id|>"),
    ("{{ '<start_of_turn>' + r + c + '<end_of_turn>' }}", "gemma", "<end_of_turn>"),
    ("{{ '<|user|>' + c + '<|end|>' }}", "phi3", "<|end|>"),
    ("{{ '[INST] ' + c + ' [/INST]' }}", "mistral", "[INST]"),
])
def test_modelfile_translates_known_chat_formats(template, fmt, stop):
    assert detect_chat_format(template) == fmt
    text = _render("modelfile", repo_id="me/run-GGUF", chat_template=template)
    assert "FROM ./run-Q8_0.gguf" in text
    assert f"# chat format: {fmt}" in text
    assert f'PARAMETER stop "{stop}"' in text
    template_block = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert "{{ .Content }}" in template_block and "{%" not in template_block


def test_modelfile_generic_template_for_unknown_format():
    assert detect_chat_format("{{ messages }}") is None and detect_chat_format(None) is None
    text = _render("modelfile", repo_id="me/run-GGUF", chat_template="{{ messages }}")
    assert "not a known format" in text and "{{ .Prompt }}" in text and "PARAMETER stop" not in text


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        render_card("space", repo_id="me/x")
    with pytest.raises(ValueError, match="repo_id"):
        render_card("merged")
    assert set(CARD_KINDS) == {"adapter", "merged", "gguf", "modelfile"}


def test_hub_cards_imports_only_jinja2_and_stdlib():
    import ast
    from pathlib import Path

    import fasttune.hub_cards as pkg

    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            bad = [r for r in roots if r != "jinja2" and r not in sys.stdlib_module_names]
            assert not bad, f"{path.name} imports {bad}"


def test_merged_card_names_the_method():
    from fasttune.hub_cards import render_card

    lora = render_card("merged", repo_id="me/m", repos={"merged": "me/m"}, lora=True)
    full = render_card("merged", repo_id="me/m", repos={"merged": "me/m"}, lora=False)
    assert "fine-tuned with LoRA" in lora and "adapter merged" in lora
    assert "fully fine-tuned" in full and "LoRA" not in full.split("---")[-1].split("## Usage")[0]


FACTS = dict(datasets=["trl-lib/Capybara"], license="llama3.2 (from the card of org/Base-1B)",
             license_meta={"license": "llama3.2"},
             method="LoRA, SFT with TRL", hyperparameters=[("learning rate", "0.0002"), ("LoRA rank (r)", "16"),
                                                           ("target", "q|v")],
             evaluation=[{"metric": "exact match", "value": "91.0%", "detail": "held-out prompts"}])


@pytest.mark.parametrize("kind", ["adapter", "merged", "gguf"])
def test_cards_state_base_data_method_license_result_and_usage(kind):
    from helpers.hub_card_check import validate_card

    text = _render(kind, **FACTS)
    meta, body = _front_matter(text)
    assert validate_card(text) == ([], [])  # what the loopback Hub (and its validate-yaml) accepts
    assert meta["license"] == "llama3.2"
    assert "| Base model | [org/Base-1B](https://huggingface.co/org/Base-1B) |" in body
    assert "| Method | LoRA, SFT with TRL |" in body
    assert "| License | llama3.2 (from the card of org/Base-1B) |" in body
    assert "| Held-out result | exact match: 91.0% |" in body
    assert "| hyperparameter | value |" in body and "| target | q\\|v |" in body  # a table, not a JSON dump
    assert "| exact match | 91.0% | held-out prompts |" in body
    assert "ollama run hf.co/me/run-GGUF:" in body and "llama-cli -hf me/run-GGUF:" in body
    usage = {"adapter": "PeftModel.from_pretrained", "merged": "AutoModelForCausalLM.from_pretrained",
             "gguf": "Llama.from_pretrained"}[kind]
    assert usage in body


@pytest.mark.parametrize("kind", ["adapter", "merged", "gguf"])
def test_a_base_without_hub_id_and_an_unknown_license_are_said_plainly(kind):
    from helpers.hub_card_check import validate_card

    note = "a local folder (my-base), so it has no Hub id"
    text = _render(kind, base_model_id=None, base_note=note, repos={kind: REPOS[kind]}, datasets=[])
    meta, body = _front_matter(text)
    assert "license" not in meta and "base_model" not in meta and validate_card(text)[0] == []
    assert f"| Base model | {note} |" in body and "| Training data | not recorded |" in body
    assert "| License | unknown — check the base model's license |" in body
    assert "| Held-out result | none measured |" in body and "No held-out evaluation was run." in body


def test_unpublished_cards_say_so_and_point_gguf_at_the_base():
    text = _render("gguf", published=False, repo_id="your-hf-username/run-GGUF",
                   repos={"merged": "your-hf-username/run", "gguf": "your-hf-username/run-GGUF"})
    meta, body = _front_matter(text)
    assert meta["base_model"] == "org/Base-1B" and meta["base_model_relation"] == "finetune"
    assert "Not on the Hub yet" in body and "fasttune push" in body


def test_invalid_front_matter_is_caught_by_the_loopback_validator():
    from helpers.hub_card_check import validate_card

    bad = "---\nbase_model: /home/me/base\nlicense: my-own\nbase_model_relation: distilled\ntags: x\n---\n# x\n"
    errors, _ = validate_card(bad)
    assert len(errors) == 4 and "not a license id" in errors[0] and "not a valid repo id" in errors[1]
    assert validate_card("# no metadata")[1] == ["empty or missing yaml metadata in repo card"]
    assert "card data" in validate_card("---\nmodel-index: [{name: x, results: [{}]}]\n---\n")[0][0]
