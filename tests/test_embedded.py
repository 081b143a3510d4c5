"""The embedded default: task, tokenizer, encoding, collation, metric."""

import torch

from fasttune import embedded


def test_task_rows_are_correct_and_seeded():
    rows = embedded.make_task(20, seed=3)
    assert rows == embedded.make_task(20, seed=3)
    for r in rows:
        word = r["prompt"].removeprefix("shift: ").removesuffix(" =")
        assert r["completion"] == " " + "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in word)


def test_tokenizer_is_one_token_per_character():
    tok = embedded.build_tokenizer()
    text = "shift: xyz = yza"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text


def test_encode_masks_the_prompt_and_collator_pads():
    tok = embedded.build_tokenizer()
    rows = embedded.make_task(3, seed=1)
    items = [embedded.encode(tok, r) for r in rows]
    for it, r in zip(items, rows):
        n_answer = len(r["completion"]) + 1  # + eos
        assert it["labels"][-n_answer:] == it["input_ids"][-n_answer:]
        assert all(x == -100 for x in it["labels"][:-n_answer])
    batch = embedded.PadCollator(tok.pad_token_id)(items)
    width = max(len(i["input_ids"]) for i in items)
    assert batch["input_ids"].shape == (3, width)
    assert ((batch["attention_mask"] == 0) == (batch["input_ids"] == tok.pad_token_id)).all()
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


def test_exact_match_scores_a_perfect_oracle_model():
    tok = embedded.build_tokenizer()
    model = embedded.build_model(tok, hidden_size=32)
    rows = embedded.make_task(4, seed=2)
    assert embedded.exact_match(model, tok, rows) == 0.0  # random init
    assert embedded.exact_match(model, tok, []) == 0.0
    assert isinstance(model, torch.nn.Module)
