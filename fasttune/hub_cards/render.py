"""Render model cards (README.md) and the Ollama Modelfile from the templates in ``templates/``.

One entry point, ``render_card(kind, **context)``, for the three repos a run publishes and the
Modelfile that ships with the GGUF files:

- "adapter": ``library_name: peft``, ``base_model``, tags ``lora`` and ``base_model:adapter:<id>``.
- "merged": ``library_name: transformers``, ``base_model_relation: finetune``.
- "gguf": ``base_model_relation: quantized`` (of the merged repo when it is published, else a
  ``finetune`` of the base), tags ``gguf`` and ``llama.cpp``, a table of files, llama.cpp / Ollama
  usage (``hf.co/<repo>:<QUANT>``).
- "modelfile": ``FROM ./<file>.gguf`` with the chat template translated to Ollama's Go template
  when it is a known format (ChatML, Llama 3, Gemma, Phi-3, Mistral [INST]), a generic one otherwise.

Front-matter values are emitted as JSON scalars/lists (valid YAML), so any id or dataset name is
quoted correctly. Secrets never reach this module: the caller passes plain data, and any mapping
key that looks like a credential is dropped from the embedded configuration.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2

CARD_KINDS = ("adapter", "merged", "gguf", "modelfile")
_TEMPLATES = {"adapter": "adapter.md.j2", "merged": "merged.md.j2", "gguf": "gguf.md.j2",
              "modelfile": "Modelfile.j2"}
_SECRET_WORDS = ("token", "password", "secret", "api_key", "apikey", "credential")

# Chat formats Ollama users meet most, recognised by their markers: (markers, Go template, stops).
_CHAT_FORMATS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    "chatml": (("<|im_start|>", "<|im_end|>"),
               "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n",
               ("<|im_start|>", "<|im_end|>")),
    "llama3": (("<|start_header_id|>", "<|eot_id|>"),
               "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
               "{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
               ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "gemma": (("<start_of_turn>", "<end_of_turn>"),
              "{{- range .Messages }}<start_of_turn>{{ if eq .Role \"assistant\" }}model{{ else }}{{ .Role }}"
              "{{ end }}\n{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n",
              ("<start_of_turn>", "<end_of_turn>")),
    "phi3": (("<|user|>", "<|end|>"),
             "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
             ("<|end|>", "<|user|>", "<|assistant|>")),
    "mistral": (("[INST]", "[/INST]"),
                "{{- range .Messages }}{{ if eq .Role \"user\" }}[INST] {{ .Content }} [/INST]"
                "{{ else if eq .Role \"assistant\" }}{{ .Content }}</s>{{ end }}{{ end }}",
                ("[INST]", "[/INST]")),
}
_GENERIC = ("{{ if .System }}{{ .System }}\n\n{{ end }}{{ if .Prompt }}{{ .Prompt }}{{ end }}{{ .Response }}", ())


def detect_chat_format(chat_template: str | None) -> str | None:
    """Name of the known chat format a Jinja chat template implements (None if unknown or absent)."""
    if not chat_template:
        return None
    for name, (markers, _, _) in _CHAT_FORMATS.items():
        if all(m in chat_template for m in markers):
            return name
    return None


def _ollama(chat_template: str | None) -> dict[str, Any]:
    fmt = detect_chat_format(chat_template)
    template, stops = (_CHAT_FORMATS[fmt][1], _CHAT_FORMATS[fmt][2]) if fmt else _GENERIC
    return {"chat_format": fmt, "ollama_template": template, "ollama_stops": list(stops)}


def _drop_secrets(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_secrets(v) for k, v in value.items()
                if not any(w in str(k).lower() for w in _SECRET_WORDS)}
    if isinstance(value, (list, tuple)):
        return [_drop_secrets(v) for v in value]
    return value


def _fmt_number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _yaml(value: Any) -> str:
    """A JSON rendering, which is valid YAML flow syntax (quotes every string safely)."""
    return json.dumps(value, ensure_ascii=False)


_ENV = jinja2.Environment(loader=jinja2.PackageLoader("fasttune.hub_cards", "templates"),
                          undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                          trim_blocks=True, lstrip_blocks=True, autoescape=False)
_ENV.filters["yaml"] = _yaml
_ENV.filters["num"] = _fmt_number
_ENV.filters["compact"] = lambda v: (json.dumps(v, ensure_ascii=False)
                                     if isinstance(v, (list, dict, bool)) or v is None else str(v))
_ENV.filters["cell"] = lambda v: " ".join(str(v).split()).replace("|", "\\|")  # one markdown table cell


def render_card(kind: str, **context: Any) -> str:
    """Renders one of ``CARD_KINDS``.

    Context keys (missing optional ones default to None/empty):
        repo_id: this repo's id. repos: {"adapter"|"merged"|"gguf": repo id or None} (cross links).
        published: False while the repo ids are placeholders (the card says so; the GGUF card then
        names the base, not the merged repo, as its base_model). endpoint: Hub URL for links.
        base_model_id: Hub id of the base model, or None; base_note: where the base came from when
        it has no Hub id. license: the license line; license_meta: its front-matter keys.
        datasets: list of dataset Hub ids; dataset_note: the data in words (a local file, the
        embedded task). method: how it was trained. hyperparameters: [(name, value)].
        evaluation: [{"metric", "value", "detail"}] held-out results. stats: {"global_step",
        "final_loss", "tokens_per_second", "peak_memory_gib", "train_runtime"}. loss_curve: image
        file name in the repo, or None; loss_curve_note: why there is none. fast_config:
        FastConfig.to_dict() (a table, secrets dropped). gguf_files: [{"file", "quant", "size"}];
        mmproj_files: [{"file", "size"}], a vision-language model's vision tower + projector;
        gguf_quant: the GGUF type usage snippets name. chat_template: the tokenizer's Jinja
        template. modelfile_gguf: GGUF file the Modelfile points at. model_name: display name.

    Returns:
        The rendered text (a README.md with YAML front matter, or a Modelfile).
    """
    if kind not in _TEMPLATES:
        raise ValueError(f"kind must be one of {CARD_KINDS}, got {kind!r}")
    if not context.get("repo_id"):
        raise ValueError("repo_id is required")
    ctx: dict[str, Any] = {
        "endpoint": "https://huggingface.co", "repos": {}, "base_model_id": None, "datasets": [],
        "stats": {}, "loss_curve": None, "loss_curve_note": None, "fast_config": None, "gguf_files": [], "mmproj_files": [],
        "chat_template": None, "modelfile_gguf": None, "model_name": None, "extra_tags": [], "published": True,
        "base_note": None, "license": "unknown — check the base model's license", "license_meta": {},
        "dataset_note": None, "method": None, "hyperparameters": [], "evaluation": [], "gguf_quant": "Q8_0",
        "lora": None,
    }
    ctx.update(context)
    ctx["endpoint"] = str(ctx["endpoint"]).rstrip("/")
    ctx["repos"] = {k: v for k, v in (ctx["repos"] or {}).items() if v}
    ctx["fast_config"] = _drop_secrets(ctx["fast_config"]) if ctx["fast_config"] else None
    ctx["model_name"] = ctx["model_name"] or ctx["repo_id"].split("/")[-1]
    ctx.update(_ollama(ctx["chat_template"]))
    ctx["ctx"] = ctx  # the shared sections read what they need from it
    return _ENV.get_template(_TEMPLATES[kind]).render(**ctx)
