"""The embedded default: task, held-out split, tokenizer, encoding, collation, metric."""

import torch

from fasttune import embedded


def _shift(word):
    return "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in word)


def test_task_rows_are_correct_and_seeded():
    rows = embedded.make_task(20, seed=3)
    assert rows == embedded.make_task(20, seed=3) != embedded.make_task(20, seed=4)
    for r in rows:
        word = embedded.word_of(r["prompt"])
        assert r["prompt"] == f"{word} =" and word.isalpha() and 3 <= len(word) <= 6
        assert r["completion"] == " " + _shift(word)
    assert embedded.shift_word("xyz") == "yza"


def test_held_out_words_are_unseen_and_distinct():
    train = embedded.make_task(3000, seed=0, min_len=3, max_len=3)  # 3-letter words collide often
    held = embedded.held_out_task(train, 150, min_len=3, max_len=3)
    prompts = [r["prompt"] for r in held]
    assert len(prompts) == 150 == len(set(prompts))
    assert not set(prompts) & {r["prompt"] for r in train}
    assert held == embedded.held_out_task(train, 150, min_len=3, max_len=3)
    assert all(r["completion"] == " " + _shift(embedded.word_of(r["prompt"])) for r in held)
    assert len(embedded.held_out_task(train)) == embedded.HELD_OUT_ROWS == 200


def test_tokenizer_characters_one_merge_and_bos():
    tok = embedded.build_tokenizer()
    text = "xyz = yza"
    pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    assert pieces == ["x", "y", "z", embedded.SEPARATOR, "Ġ", "y", "z", "a"]
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok) == 3 + 256 + 1
    # letters stay one token each wherever they are; a lone "=" is not merged
    assert len(tok("abc=cab  =", add_special_tokens=False)["input_ids"]) == 9


def test_tokenizer_survives_save_and_reload(tmp_path):
    from transformers import AutoTokenizer

    tok = embedded.build_tokenizer()
    tok.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "qwerty = rxfsuz"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.chat_template == tok.chat_template
    assert (again.bos_token, again.eos_token, again.pad_token) == ("<s>", "</s>", "<pad>")


def test_chat_template_matches_the_prompt_completion_encoding():
    tok = embedded.build_tokenizer()
    row = embedded.make_task(1, seed=5)[0]
    chat = tok.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                    {"role": "assistant", "content": row["completion"]}], tokenize=False)
    assert tok(chat, add_special_tokens=False)["input_ids"] == embedded.encode(tok, row)["input_ids"]


def test_encode_masks_the_prompt_and_collator_pads():
    tok = embedded.build_tokenizer()
    rows = embedded.make_task(3, seed=1)
    items = [embedded.encode(tok, r) for r in rows]
    for it, r in zip(items, rows):
        assert it["input_ids"] == tok(r["prompt"] + r["completion"])["input_ids"] + [tok.eos_token_id]
        n_answer = len(r["completion"]) + 1  # + eos
        assert it["labels"][-n_answer:] == it["input_ids"][-n_answer:]
        assert all(x == -100 for x in it["labels"][:-n_answer])
    batch = embedded.PadCollator(tok.pad_token_id)(items)
    width = max(len(i["input_ids"]) for i in items)
    assert batch["input_ids"].shape == (3, width)
    assert ((batch["attention_mask"] == 0) == (batch["input_ids"] == tok.pad_token_id)).all()
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


class _Oracle(torch.nn.Module):
    """Generates the right answer for the first ``n_right`` prompts of a batch and a wrong one after."""

    def __init__(self, tok, n_right):
        super().__init__()
        self.tok, self.n_right, self.w = tok, n_right, torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        outs = []
        for i, ids in enumerate(input_ids.tolist()):
            word = embedded.word_of(self.tok.decode(ids, skip_special_tokens=True))
            answer = " " + (embedded.shift_word(word) if i < self.n_right else word)
            new = self.tok(answer, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            outs.append(ids + new + [self.tok.pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(outs)


def test_exact_match_counts_exact_answers_only():
    tok = embedded.build_tokenizer()
    rows = embedded.make_task(8, seed=2)
    assert embedded.exact_match(_Oracle(tok, 8), tok, rows) == 1.0
    assert embedded.exact_match(_Oracle(tok, 3), tok, rows) == 3 / 8
    model = embedded.build_model(tok, hidden_size=32)
    assert embedded.exact_match(model, tok, rows) == 0.0  # random init
    assert embedded.exact_match(model, tok, []) == 0.0
    assert tok.padding_side == "right"  # restored after the left-padded generation


def test_metric_description_says_what_it_measures():
    text = embedded.describe_exact_match(0.925)
    assert text.startswith("held-out exact match 92.5%") and "200 unseen words" in text and "exactly" in text
    assert "unseen words" in embedded.describe_exact_match(0.5, None)
