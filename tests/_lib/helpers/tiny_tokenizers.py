"""Tiny tokenizers built in-process (no downloads), with chat templates.

- ``bpe_tokenizer()``: byte-level BPE (GPT-2 style pre-tokenizer), ChatML template with
  ``{% generation %}`` markers, ``<|im_start|>``/``<|im_end|>`` special tokens. llama.cpp reads it
  as a "gpt2" vocabulary with the "gpt-2" pre-tokenizer.
- ``sp_tokenizer()``: a SentencePiece BPE model with byte fallback, trained in-process and
  wrapped as a transformers ``LlamaTokenizer`` (vocab + merges, Metaspace ``▁``), Gemma-style
  ``<start_of_turn>``/``<end_of_turn>`` template. llama.cpp reads it as a "llama" (SPM) vocabulary.

Each takes ~0.1 s. Sizes stay small (a few hundred tokens) so models padded to a vocabulary of
512 rows have real tokens and unused padding rows.
"""

from __future__ import annotations

import functools
import io

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today? I'm fine, thanks!",
    "Fine-tuning language models is fun and fast with fused kernels.",
    "Numbers like 12345 and 3.14 appear; symbols too: !?#$%&*()[]{}",
    "user: what is the capital of France?\nassistant: Paris is the capital.",
    "Ünïcödé têxt, naïve café, and emoji 🦙 test.",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<end_of_turn>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<end_of_turn>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def bpe_tokenizer(vocab_size: int = 400):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with a ChatML chat template.

    Special tokens: ``<|endoftext|>`` (bos/eos/pad), ``<|im_start|>``, ``<|im_end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None)
    out.add_special_tokens({"additional_special_tokens": specials[1:]})
    out.chat_template = CHATML_TEMPLATE
    return out


@functools.lru_cache(maxsize=None)
def sp_model_bytes(vocab_size: int = 400, add_prefix_space: bool = False) -> bytes:
    """The serialized SentencePiece BPE model (byte fallback) behind ``sp_tokenizer`` (deterministic)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 20), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], hard_vocab_limit=False, minloglevel=2,
        add_dummy_prefix=add_prefix_space, split_digits=True, num_threads=1)
    return buf.getvalue()


def _sp_pieces(vocab_size: int, dummy_prefix: bool) -> list[tuple[str, float, int]]:
    """(piece, score, type) of the SentencePiece model; type: 0 normal, 1 unknown, 2 control, 3 byte."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=sp_model_bytes(vocab_size, dummy_prefix))
    pieces = []
    for i in range(sp.get_piece_size()):
        kind = 1 if sp.is_unknown(i) else 2 if sp.is_control(i) else 3 if sp.is_byte(i) else 0
        pieces.append((sp.id_to_piece(i), sp.get_score(i), kind))
    return pieces


def _merges_from_vocab(vocab: dict[str, int], mergeable: set[str]) -> list[tuple[str, str]]:
    """BPE merges reproducing SentencePiece's order: every split of a piece into two known pieces,
    ranked by the merged piece's id (SentencePiece ids follow score order), then by the parts' ids."""
    merges = []
    for piece, pid in vocab.items():
        if piece not in mergeable or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in mergeable and right in mergeable:
                merges.append((pid, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def sp_tokenizer(vocab_size: int = 400, add_prefix_space: bool = False, **named_tokens: str):
    """A SentencePiece-style ``LlamaTokenizer`` (BPE, byte fallback, ``▁`` spaces) with a Gemma-style
    chat template. ``<start_of_turn>``/``<end_of_turn>`` are special tokens.

    ``add_prefix_space=False`` (default) behaves like Gemma's tokenizer (no dummy ``▁`` prefix);
    True like Llama 2's. ``named_tokens`` (e.g. ``image_token="<image_soft_token>"``) become added
    special tokens the tokenizer names as attributes (``tok.image_token``, ``tok.image_token_id``),
    as a multimodal model's processor expects.
    """
    from transformers import LlamaTokenizer

    pieces = _sp_pieces(vocab_size, add_prefix_space)
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    mergeable = {p for p, _, kind in pieces if kind == 0 and p not in ("<start_of_turn>", "<end_of_turn>")}
    merges = _merges_from_vocab(vocab, mergeable)
    tok = LlamaTokenizer(vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                         add_prefix_space=add_prefix_space, **named_tokens)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", *named_tokens.values()]})
    tok.chat_template = GEMMA_TEMPLATE
    return tok
