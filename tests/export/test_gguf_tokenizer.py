"""gguf_tokenizer: the vocabulary part of a GGUF file (BPE byte-level and SentencePiece-style)."""

import gguf
import pytest

from fasttune.export.gguf_tokenizer import _pre_tokenizer_name, add_tokenizer
from helpers.tiny_tokenizers import bpe_tokenizer, sp_tokenizer


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
    ({"type": "Whitespace"}, "default"),
])
def test_pre_tokenizer_recognition(pre, name):
    assert _pre_tokenizer_name(pre) == name
