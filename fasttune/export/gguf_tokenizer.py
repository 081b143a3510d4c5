"""The tokenizer part of a GGUF file, from a transformers tokenizer.

Two vocabulary kinds llama.cpp reads:

- "gpt2": byte-level BPE (tokens in the GPT-2 byte alphabet, merges). Its pre-tokenizer
  (``tokenizer.ggml.pre``) is recognised from the ``tokenizer.json`` pre-tokenizer itself (the
  regex or the plain ByteLevel one) instead of hashing a probe text; an unknown one falls back
  to "default" with a warning.
- "llama" (SentencePiece, SPM): pieces with ``▁`` spaces and ``<0xXX>`` byte tokens, ranked by
  scores. Scores come from the SentencePiece model when the tokenizer still has it
  (``vocab_file``), else from the BPE merge ranks of ``tokenizer.json`` (a converted
  SentencePiece BPE model merges in score order, so rank and score carry the same order).

Ids beyond the tokenizer but inside the embedding become ``[PAD<i>]`` unused tokens. Special
ids, whether BOS/EOS are added (measured by encoding a probe), the end-of-turn token and the chat
template are written too.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# tokenizer.json Split regexes → llama.cpp pre-tokenizer names (same splitting rules).
_PRE_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)": "gpt-2",
}
# End-of-turn markers of common chat templates, in the order they are looked for.
EOT_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def tokenizer_json(tokenizer) -> dict[str, Any]:
    """The ``tokenizers`` JSON of a fast/tokenizers-backed tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} has no tokenizers backend (tokenizer.json); "
                        "load it with a fast tokenizer to export GGUF")
    return json.loads(backend.to_str())


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    if not pre:
        return "default"
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "refact"
    splits = [p for p in parts if p.get("type") == "Split"]
    if len(splits) == 1 and kinds[-1] == "ByteLevel" and not parts[-1].get("use_regex", True):
        regex = splits[0].get("pattern", {}).get("Regex")
        if regex in _PRE_REGEXES:
            return _PRE_REGEXES[regex]
    logger.warning("unrecognised BPE pre-tokenizer %s: writing 'default'; llama.cpp may split text "
                   "differently from transformers", kinds)
    return "default"


def _id_to_token(tj: dict[str, Any], n_vocab: int) -> dict[int, str]:
    vocab = tj["model"]["vocab"]
    tokens = {i: t for t, i in vocab.items()} if isinstance(vocab, dict) else dict(enumerate(v[0] for v in vocab))
    for added in tj.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
    too_big = [i for i in tokens if i >= n_vocab]
    if too_big:
        raise ValueError(f"the tokenizer has token ids up to {max(too_big)} but the model's embedding has only "
                         f"{n_vocab} rows: resize the embeddings before exporting")
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
    def walk(node):
        if not node:
            return []
        return [n for sub in node.get("pretokenizers", node.get("normalizers", [])) for n in walk(sub)] or [node]

    for node in walk(tj.get("pre_tokenizer")) + walk(tj.get("normalizer")):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") in ("always", "first"):
            return True
        if node.get("type") == "Prepend" and node.get("prepend") == "▁":
            return True
    return False


def add_tokenizer(writer, tokenizer, n_vocab: int) -> dict[str, Any]:
    """Writes the vocabulary, special tokens and chat template of ``tokenizer`` for ``n_vocab`` rows.

    Returns:
        {"model": "gpt2" | "llama", "pre": pre-tokenizer name or None, "special": {kind: id}}.
    """
    import gguf

    tj = tokenizer_json(tokenizer)
    model = tj["model"]
    if model.get("type") != "BPE":
        raise NotImplementedError(f"GGUF export supports BPE tokenizers (byte-level or SentencePiece-style), "
                                  f"got a {model.get('type')} model")
    spm_style = bool(model.get("byte_fallback"))
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

    if spm_style:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(_adds_space_prefix(tj))
        pre = None
    else:
        pre = _pre_tokenizer_name(tj.get("pre_tokenizer"))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(_merges(tj))

    for kind, tid in special.items():
        getattr(writer, f"add_{kind}_token_id")(tid)
    add_bos, add_eos = _adds_bos_eos(tokenizer, special)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = [{"name": k, "template": v} for k, v in template.items()]
    if template:
        writer.add_chat_template(template)
    return {"model": "llama" if spm_style else "gpt2", "pre": pre, "special": special}
