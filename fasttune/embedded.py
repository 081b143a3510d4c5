"""The embedded default: a small model, tokenizer and task built in-process, with no download.

The task ("shift"): each letter of a short lowercase word moves one place along the alphabet,
prompt ``"cab ="`` → completion ``" dbc"``. A randomly initialised model gets 0% exact match; about
200 steps of full fine-tuning (a minute or two on a 2-core CPU) take it above 90% on words it never
saw, so the demos show the loss falling and a held-out metric rising. Used by
``examples/quickstart.py``, the YAML demo, the CLI, the Space and the tests.

The prompt is the bare word: no instruction text. Lowercase letters in a fixed prefix (an earlier
``"shift: cab ="``) give the model's copy-the-next-letter circuit false matches, and the same
model then needed 2-3x more steps, with seeds that never got there.
"""

from __future__ import annotations

import random
import string

import torch

LETTERS = string.ascii_lowercase
SEPARATOR = "Ġ="  # the merged " =" token (byte-level spelling)
HELD_OUT_ROWS = 200
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% endif %}{% endfor %}"
)


def shift_word(word: str) -> str:
    return "".join(LETTERS[(LETTERS.index(c) + 1) % 26] for c in word)


def prompt_for(word: str) -> str:
    return f"{word} ="


def word_of(prompt: str) -> str:
    """The word of a task prompt (``"cab ="`` → ``"cab"``)."""
    return prompt.removesuffix(" =")


def _words(seed: int, min_len: int, max_len: int):
    rng = random.Random(seed)
    while True:
        yield "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))


def make_task(n: int, seed: int = 0, min_len: int = 3, max_len: int = 6) -> list[dict[str, str]]:
    """``n`` prompt/completion pairs of the shift task (random words; a word may repeat)."""
    words = _words(seed, min_len, max_len)
    return [{"prompt": prompt_for(w), "completion": " " + shift_word(w)} for w, _ in zip(words, range(n))]


def held_out_task(train_rows: list[dict[str, str]], n: int = HELD_OUT_ROWS, seed: int = 10_000,
                  min_len: int = 3, max_len: int = 6) -> list[dict[str, str]]:
    """``n`` distinct words that none of ``train_rows`` (their prompts) contains, as task rows."""
    seen = {r["prompt"] for r in train_rows}
    rows = []
    for w in _words(seed, min_len, max_len):
        if len(rows) == n:
            return rows
        if prompt_for(w) not in seen:
            seen.add(prompt_for(w))
            rows.append({"prompt": prompt_for(w), "completion": " " + shift_word(w)})
    return rows


def describe_exact_match(score: float, n: int | None = HELD_OUT_ROWS) -> str:
    """What the held-out metric says, in words, for logs and UIs (``n``: how many words; None if unknown)."""
    count = f"{n} " if n else ""
    return (f"held-out exact match {score:.1%}: the share of {count}unseen words whose shifted spelling "
            f"the model generates exactly (greedy decoding)")


def build_tokenizer():
    """A character-level byte-level BPE tokenizer built in-process (no training, ~1 ms), with a chat template.

    Every byte is its own token (so the task's letters stay single tokens) and there is one merge,
    ``"Ġ" + "=" -> "Ġ="``: the prompt's closing " =" becomes one token that occurs nowhere else.
    A byte-level BPE needs at least one merge to be expressed in GGUF (llama.cpp refuses a "gpt2"
    vocabulary without merges). BOS is added by the post-processor, as Llama's tokenizers do, so
    TRL's tokenization, ``encode`` and llama.cpp all see ``<s>`` first.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab[SEPARATOR] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "=")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "right"
    return fast


def build_model(tokenizer, hidden_size: int = 128, layers: int = 2, seed: int = 0, dtype=torch.float32):
    """A small randomly initialised Llama-architecture causal LM sized for the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 3,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(dtype)


def encode(tokenizer, row: dict[str, str], max_length: int = 32) -> dict[str, list[int]]:
    """input_ids/attention_mask/labels for one pair; prompt tokens are masked out of the loss."""
    prompt = [tokenizer.bos_token_id] + tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    answer = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_length]
    labels = ([-100] * len(prompt) + answer)[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


class TaskDataset(torch.utils.data.Dataset):
    """Encoded rows for the Trainer (pad with ``collate``)."""

    def __init__(self, tokenizer, rows: list[dict[str, str]], max_length: int = 32):
        self.items = [encode(tokenizer, r, max_length) for r in rows]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.items[i]


class PadCollator:
    """Right-pads input_ids (pad id), attention_mask (0) and labels (-100) to the batch maximum."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        out = {}
        for key, pad in (("input_ids", self.pad_token_id), ("attention_mask", 0), ("labels", -100)):
            out[key] = torch.tensor([f[key] + [pad] * (width - len(f[key])) for f in features])
        return out


@torch.no_grad()
def exact_match(model, tokenizer, rows: list[dict[str, str]], batch_size: int = 64) -> float:
    """Share of rows whose greedy completion equals the reference exactly."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    hits = 0
    tokenizer.padding_side = "left"
    try:
        for s in range(0, len(rows), batch_size):
            chunk = rows[s:s + batch_size]
            prompts = [tokenizer.bos_token + r["prompt"] for r in chunk]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            max_new = max(len(r["completion"]) for r in chunk) + 1
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            hits += sum(t == r["completion"] for t, r in zip(texts, chunk))
    finally:
        tokenizer.padding_side = "right"
        model.train(was_training)
    return hits / max(len(rows), 1)
