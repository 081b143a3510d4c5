"""The tokenizer part of a GGUF file, from a transformers tokenizer: checked whole, then written.

``gguf_vocab(tokenizer, n_vocab)`` reads everything llama.cpp needs into a ``GGUFVocab`` or raises
``ValueError`` saying why llama.cpp could not reproduce the tokenizer; ``save_gguf`` calls it
before any file is opened. ``write_vocab`` writes it into each GGUF file. Two vocabulary kinds:

- "gpt2": byte-level BPE (tokens in the GPT-2 byte alphabet, merges). llama.cpp refuses a "gpt2"
  vocabulary without merges, so a merge-less byte-level BPE is refused here. The pre-tokenizer
  (``tokenizer.ggml.pre``) is recognised from the ``tokenizer.json`` pre-tokenizer itself (the
  Split regex, or the plain ByteLevel one) instead of hashing a probe text; an unknown one is
  refused, since llama.cpp would split text differently.
- "llama" (SentencePiece, SPM): BPE with byte fallback, pieces with ``▁`` spaces and ``<0xXX>``
  byte tokens, ranked by scores. Scores come from the SentencePiece model when the tokenizer still
  has it (``vocab_file``), else from the BPE merge ranks of ``tokenizer.json`` (a converted
  SentencePiece BPE model merges in score order, so rank and score carry the same order).

Other models (WordPiece, Unigram, WordLevel), plain BPE that is neither byte-level nor
byte-fallback, normalizers llama.cpp does not apply (only NFC for byte-level BPE and the
SentencePiece space replacement are accepted) and tokenizers without an EOS token are refused.
Ids beyond the tokenizer but inside the embedding become ``[PAD<i>]`` unused tokens. Special
ids, whether BOS/EOS are added (measured by encoding a probe), the end-of-turn token and the chat
template are written too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# tokenizer.json Split regexes → llama.cpp pre-tokenizer names (same splitting rules).
_PRE_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)": "gpt-2",
}
SUPPORTED_PRE = ("ByteLevel (GPT-2 regex)", "Digits + ByteLevel (refact)",
                 "Split with the Llama 3 / Qwen2 / GPT-2 regex + ByteLevel")
# End-of-turn markers of common chat templates, in the order they are looked for.
EOT_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
_SPM_NORMALIZERS = ({"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                    {"type": "Prepend", "prepend": "▁"})


@dataclass(frozen=True)
class GGUFVocab:
    """Everything the GGUF file says about the tokenizer.

    Attributes:
        model: "gpt2" (byte-level BPE) or "llama" (SentencePiece-style).
        pre: ``tokenizer.ggml.pre`` ("default" for SentencePiece).
        tokens, types, scores: one entry per embedding row (scores only for "llama").
        merges: "left right" strings, byte-level spelling (only for "gpt2").
        special: kind ("bos", "eos", "unk", "pad", "eot") → id.
        add_bos, add_eos: whether encoding adds them (measured on a probe).
        add_space_prefix: SentencePiece's dummy "▁" prefix (None for "gpt2").
        chat_template: the template string, a list of named templates, or None.
    """

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special: dict[str, int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool | None
    chat_template: Any


def tokenizer_json(tokenizer) -> dict[str, Any]:
    """The ``tokenizers`` JSON of a fast/tokenizers-backed tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"tokenizer: {type(tokenizer).__name__} has no tokenizers backend (tokenizer.json); "
                        "load it with a fast tokenizer to export GGUF")
    return json.loads(backend.to_str())


def _flatten(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [leaf for sub in node.get(key, []) for leaf in _flatten(sub, key)]
    return [node]


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str | None:
    """llama.cpp's name for a byte-level BPE pre-tokenizer, or None when it has no equivalent."""
    parts = _flatten(pre, "pretokenizers")
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "refact"
    splits = [p for p in parts if p.get("type") == "Split"]
    if len(splits) == 1 and kinds[-1] == "ByteLevel" and not parts[-1].get("use_regex", True):
        return _PRE_REGEXES.get(splits[0].get("pattern", {}).get("Regex"))
    return None


def _refuse(reason: str) -> ValueError:
    return ValueError(f"tokenizer: {reason}; llama.cpp could not reproduce this tokenizer, so no GGUF was written")


def _check_byte_level(tj: dict[str, Any]) -> str:
    """The pre-tokenizer name of a byte-level BPE that llama.cpp can express, else ValueError."""
    model = tj["model"]
    if not model.get("merges"):
        raise _refuse("a byte-level BPE without merges ('gpt2' in GGUF) is refused by llama.cpp "
                      "('cannot find tokenizer merges'); give the tokenizer at least one merge")
    parts = _flatten(tj.get("pre_tokenizer"), "pretokenizers")
    if any(p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in parts):
        raise _refuse("ByteLevel(add_prefix_space=True) has no llama.cpp equivalent")
    pre = _pre_tokenizer_name(tj.get("pre_tokenizer"))
    if pre is None:
        raise _refuse(f"unrecognised byte-level pre-tokenizer {[p.get('type') for p in parts]} "
                      f"(supported: {'; '.join(SUPPORTED_PRE)})")
    if model.get("ignore_merges") and pre != "llama-bpe":
        raise _refuse(f"ignore_merges=True is applied by llama.cpp only with the 'llama-bpe' pre-tokenizer, "
                      f"not {pre!r}")
    for norm in _flatten(tj.get("normalizer"), "normalizers"):
        if norm.get("type") != "NFC":  # NFC leaves already-composed text alone
            raise _refuse(f"the {norm.get('type')} normalizer has no llama.cpp equivalent for byte-level BPE")
    return pre


def _check_sentencepiece(tj: dict[str, Any]) -> None:
    for norm in _flatten(tj.get("normalizer"), "normalizers"):
        if norm not in _SPM_NORMALIZERS:
            raise _refuse(f"the {norm.get('type')} normalizer has no llama.cpp equivalent for SentencePiece")
    for pre in _flatten(tj.get("pre_tokenizer"), "pretokenizers"):
        if pre.get("type") != "Metaspace" or pre.get("replacement", "▁") != "▁":
            raise _refuse(f"the {pre.get('type')} pre-tokenizer has no llama.cpp equivalent for SentencePiece")


def _is_byte_level(tj: dict[str, Any]) -> bool:
    parts = _flatten(tj.get("pre_tokenizer"), "pretokenizers") + _flatten(tj.get("decoder"), "decoders")
    return any(p.get("type") == "ByteLevel" for p in parts)


def _id_to_token(tj: dict[str, Any], n_vocab: int) -> dict[int, str]:
    vocab = tj["model"]["vocab"]
    tokens = {i: t for t, i in vocab.items()} if isinstance(vocab, dict) else dict(enumerate(v[0] for v in vocab))
    for added in tj.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
    too_big = [i for i in tokens if i >= n_vocab]
    if too_big:
        raise ValueError(f"the tokenizer has token ids up to {max(too_big)} but the model's embedding has only "
                         f"{n_vocab} rows: resize the embeddings before exporting")
    seen: dict[str, int] = {}
    for i, t in sorted(tokens.items()):
        if t in seen:
            raise _refuse(f"ids {seen[t]} and {i} share the text {t!r} (llama.cpp maps text to one id)")
        seen[t] = i
    return tokens


def _merges(tj: dict[str, Any]) -> list[str]:
    out = []
    for m in tj["model"].get("merges", []):
        pair = m.split(" ", 1) if isinstance(m, str) else m
        out.append(" ".join(part.replace(" ", chr(ord(" ") + 256)) for part in pair))
    return out


def _sp_scores(tokenizer) -> dict[str, float] | None:
    """piece → score from the tokenizer's SentencePiece model file, when it still has one."""
    path = getattr(tokenizer, "vocab_file", None) or getattr(tokenizer, "init_kwargs", {}).get("vocab_file")
    if not path or not str(path).endswith(".model") or not Path(path).is_file():
        return None
    try:
        import sentencepiece as spm
    except ImportError:
        return None
    sp = spm.SentencePieceProcessor(model_file=str(path))
    return {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}


def _rank_scores(tj: dict[str, Any]) -> dict[str, float]:
    """Scores that reproduce BPE merge order: the token a merge produces scores -(rank + 1)."""
    scores: dict[str, float] = {}
    for rank, m in enumerate(tj["model"].get("merges", [])):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        scores.setdefault(left + right, -float(rank + 1))
    return scores


def _special_ids(tokenizer, n_vocab: int) -> dict[str, int]:
    ids = {}
    for kind in ("bos", "eos", "unk", "pad"):
        tid = getattr(tokenizer, f"{kind}_token_id", None)
        if isinstance(tid, int) and 0 <= tid < n_vocab:
            ids[kind] = tid
    if "eos" not in ids:
        raise _refuse("no eos_token (llama.cpp would never stop generating); set tokenizer.eos_token")
    vocab = tokenizer.get_vocab()
    for tok in EOT_TOKENS:
        if tok in vocab and vocab[tok] < n_vocab:
            ids["eot"] = vocab[tok]
            break
    return ids


def _adds_bos_eos(tokenizer, ids: dict[str, int]) -> tuple[bool, bool]:
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    add_bos = bool(probe) and "bos" in ids and probe[0] == ids["bos"]
    add_eos = bool(probe) and "eos" in ids and probe[-1] == ids["eos"]
    return add_bos, add_eos


def _adds_space_prefix(tj: dict[str, Any]) -> bool:
    nodes = _flatten(tj.get("pre_tokenizer"), "pretokenizers") + _flatten(tj.get("normalizer"), "normalizers")
    for node in nodes:
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") in ("always", "first"):
            return True
        if node.get("type") == "Prepend" and node.get("prepend") == "▁":
            return True
    return False


def _chat_template(tokenizer) -> Any:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return [{"name": k, "template": v} for k, v in template.items()]
    return template or None


def gguf_vocab(tokenizer, n_vocab: int) -> GGUFVocab:
    """The GGUF vocabulary of ``tokenizer`` for an embedding of ``n_vocab`` rows.

    Raises:
        TypeError: the tokenizer has no ``tokenizers`` backend.
        ValueError: llama.cpp could not reproduce the tokenizer (the message says why), or the
            tokenizer has more ids than the embedding has rows.
    """
    import gguf

    tj = tokenizer_json(tokenizer)
    model = tj["model"]
    if model.get("type") != "BPE":
        raise _refuse(f"GGUF export supports BPE tokenizers (byte-level or SentencePiece-style), "
                      f"got a {model.get('type')} model")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise _refuse("BPE subword prefixes/suffixes have no llama.cpp equivalent")
    spm_style = bool(model.get("byte_fallback"))
    if spm_style:
        _check_sentencepiece(tj)
        pre = "default"
    elif _is_byte_level(tj):
        pre = _check_byte_level(tj)
    else:
        raise _refuse("a BPE that is neither byte-level (ByteLevel pre-tokenizer) nor SentencePiece-style "
                      "(byte_fallback=True) has no llama.cpp vocabulary type")
    id_to_tok = _id_to_token(tj, n_vocab)
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    special = _special_ids(tokenizer, n_vocab)

    tokens, types, scores = [], [], []
    sp_scores = (_sp_scores(tokenizer) or _rank_scores(tj)) if spm_style else {}
    for i in range(n_vocab):
        tok = id_to_tok.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            scores.append(-1000.0)
            continue
        tokens.append(tok)
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
            scores.append(0.0)
        elif spm_style and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok):
            types.append(gguf.TokenType.BYTE)
            scores.append(0.0)
        elif spm_style and i == special.get("unk"):
            types.append(gguf.TokenType.UNKNOWN)
            scores.append(0.0)
        else:
            types.append(gguf.TokenType.NORMAL)
            # single characters need no score; unmerged multi-character pieces merge last
            scores.append(sp_scores.get(tok, 0.0 if len(tok) == 1 else -1e9) if spm_style else 0.0)
    add_bos, add_eos = _adds_bos_eos(tokenizer, special)
    return GGUFVocab(model="llama" if spm_style else "gpt2", pre=pre, tokens=tokens, types=[int(t) for t in types],
                     scores=scores if spm_style else None, merges=None if spm_style else _merges(tj),
                     special=special, add_bos=add_bos, add_eos=add_eos,
                     add_space_prefix=_adds_space_prefix(tj) if spm_style else None,
                     chat_template=_chat_template(tokenizer))


def write_vocab(writer, vocab: GGUFVocab) -> None:
    """Writes ``vocab`` (from ``gguf_vocab``) into a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    for kind, tid in vocab.special.items():
        getattr(writer, f"add_{kind}_token_id")(tid)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def add_tokenizer(writer, tokenizer, n_vocab: int) -> dict[str, Any]:
    """``write_vocab(writer, gguf_vocab(tokenizer, n_vocab))``.

    Returns:
        {"model": "gpt2" | "llama", "pre": pre-tokenizer name or None, "special": {kind: id}}.
    """
    vocab = gguf_vocab(tokenizer, n_vocab)
    write_vocab(writer, vocab)
    return {"model": vocab.model, "pre": None if vocab.model == "llama" else vocab.pre, "special": vocab.special}
