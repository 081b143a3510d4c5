"""Trying a finished run's model: greedy, tokenized as in training, cached per run."""

from __future__ import annotations

import pytest
import torch

from fasttune import embedded
from fasttune.run.config import RunConfig
from fasttune.run.folder import RunFolder
from fasttune.run.generate import RunGenerator


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A full fine-tune's run folder as `fasttune train` leaves it (the embedded model, untrained)."""
    folder = RunFolder(tmp_path_factory.mktemp("gen") / "run")
    folder.start(RunConfig.from_dict({"method": "full"}))
    tok = embedded.build_tokenizer()
    embedded.build_model(tok, seed=3).save_pretrained(folder.final)
    tok.save_pretrained(folder.final)
    folder.write_state(status="completed", data_columns=["prompt", "completion"])
    return folder, tok


def _greedy(folder, text: str, n: int, tok) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder.final).eval()
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_generates_what_the_model_would_and_follows_the_data_format(finished_run):
    folder, tok = finished_run
    generate = RunGenerator(max_new_tokens=6)
    answer = generate(folder.path, "shift: cab =")
    assert answer == _greedy(folder, "shift: cab =", 6, tok) and answer  # a random model still says something
    assert generate(folder.path, "shift: cab =") == answer  # cached, same answer
    folder.write_state(data_columns=["messages"])  # chat data: through the chat template
    generate = RunGenerator(max_new_tokens=6)
    chat = tok.apply_chat_template([{"role": "user", "content": "shift: cab ="}], tokenize=False,
                                   add_generation_prompt=True)
    assert generate(folder.path, "shift: cab =") == _greedy(folder, chat, 6, tok)
    folder.write_state(data_columns=["prompt", "completion"])


def test_bad_requests_say_what_is_wrong(finished_run, tmp_path):
    folder, _ = finished_run
    generate = RunGenerator()
    with pytest.raises(ValueError, match="prompt: type something"):
        generate(folder.path, "  ")
    with pytest.raises(ValueError, match="leave no room in the model's 64-token context"):
        generate(folder.path, "shift: " + "a" * 80)
    with pytest.raises(FileNotFoundError, match="is not a finished fasttune run"):
        generate(tmp_path, "hello")
