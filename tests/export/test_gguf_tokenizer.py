"""gguf_tokenizer: the vocabulary part of a GGUF file (BPE byte-level and SentencePiece-style), written
whole, and tokenizers llama.cpp could not reproduce refused before any file exists."""

import gguf
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fasttune import embedded
from fasttune.export.gguf import save_gguf
from fasttune.export.gguf_tokenizer import _pre_tokenizer_name, add_tokenizer, gguf_vocab
from helpers.gguf_models import gguf_model
from helpers.tiny_tokenizers import bpe_tokenizer, sp_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog"] * 20


@pytest.mark.parametrize("make, model", [(bpe_tokenizer, "gpt2"), (sp_tokenizer, "llama")], ids=["bpe", "sp"])
def test_written_vocab_reads_back(make, model, tmp_path):
    tok = make()
    n_vocab = len(tok) + 3  # rows beyond the tokenizer become padding tokens
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    info = add_tokenizer(writer, tok, n_vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert info["model"] == model
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    assert len(tokens) == n_vocab and len(set(tokens)) == n_vocab
    vocab = tok.get_vocab()
    for text, idx in list(vocab.items())[:50]:
        assert tokens[idx] == text or model == "llama"  # SentencePiece pieces are stored in their own form
    eos = reader.fields["tokenizer.ggml.eos_token_id"]
    assert int(eos.parts[eos.data[0]][0]) == tok.eos_token_id
    assert "tokenizer.chat_template" in reader.fields or tok.chat_template is None
    assert ("tokenizer.ggml.merges" in reader.fields) == (model == "gpt2")
    assert ("tokenizer.ggml.scores" in reader.fields) == (model == "llama")


def test_the_embedded_tokenizer_is_written_whole():
    tok = embedded.build_tokenizer()
    vocab = gguf_vocab(tok, len(tok))
    assert (vocab.model, vocab.pre, vocab.merges) == ("gpt2", "gpt-2", ["Ġ ="])
    assert vocab.tokens[tok.convert_tokens_to_ids(embedded.SEPARATOR)] == embedded.SEPARATOR
    assert vocab.special == {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    assert (vocab.add_bos, vocab.add_eos) == (True, False)
    assert vocab.chat_template == embedded.CHAT_TEMPLATE
    assert [vocab.types[i] for i in (0, 1, 2)] == [gguf.TokenType.CONTROL] * 3


@pytest.mark.parametrize("pre, name", [
    ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}, "llama-bpe"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}, "qwen2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                            {"type": "ByteLevel", "use_regex": True}]}, "refact"),
    ({"type": "Whitespace"}, None),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": r"\w+|\S"}},
                                            {"type": "ByteLevel", "use_regex": False}]}, None),
])
def test_pre_tokenizer_recognition(pre, name):
    assert _pre_tokenizer_name(pre) == name


def _byte_level(merges=True, normalizer=None, pre=None, eos="</s>"):
    """A byte-level BPE ``PreTrainedTokenizerFast``, trained in-process (with or without merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=300 if merges else 1, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos)


def _word_piece():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainer=trainers.WordPieceTrainer(
        vocab_size=100, special_tokens=["[UNK]", "</s>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")


def _plain_bpe():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<unk>", "</s>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


REFUSED = {
    "byte-level without merges": (lambda: _byte_level(merges=False), "without merges"),
    "wordpiece": (_word_piece, "got a WordPiece model"),
    "plain bpe": (_plain_bpe, "neither byte-level"),
    "lowercase normalizer": (lambda: _byte_level(normalizer=normalizers.Lowercase()), "Lowercase normalizer"),
    "unknown split regex": (lambda: _byte_level(pre=pre_tokenizers.Sequence([
        pre_tokenizers.Split(r"\w+", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
        r"unrecognised byte-level pre-tokenizer \['Split', 'ByteLevel'\]"),
    "prefix space": (lambda: _byte_level(pre=pre_tokenizers.ByteLevel(add_prefix_space=True)), "add_prefix_space"),
    "no eos": (lambda: _byte_level(eos=None), "no eos_token"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_inexpressible_tokenizers_are_refused_before_any_file(case, tmp_path):
    make, message = REFUSED[case]
    tok = make()
    with pytest.raises(ValueError, match=message) as info:
        gguf_vocab(tok, 512)
    assert "llama.cpp could not reproduce this tokenizer" in str(info.value)
    with pytest.raises(ValueError, match=message):
        save_gguf(gguf_model("llama"), tok, tmp_path / "out", ["f16", "q8_0"])
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_without_a_tokenizers_backend_is_a_type_error():
    with pytest.raises(TypeError, match="no tokenizers backend"):
        gguf_vocab(object(), 512)
