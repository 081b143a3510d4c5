"""What the loopback Hub does with a README.md: validate its YAML front matter, render it as a page.

``validate_card(content)`` answers ``POST /api/validate-yaml`` like the Hub: the front matter must
parse as a YAML mapping, build huggingface_hub's own ``ModelCardData`` (which checks ``model-index``
/ eval results), and its known fields must hold values the Hub accepts: a license id from the Hub's
list (``other`` needs ``license_name``), repo ids that pass ``validate_repo_id`` for ``base_model``
and ``datasets`` (so a local path is refused), a ``base_model_relation`` the Hub knows (and a
``base_model`` beside it), a known ``pipeline_tag``, lists of strings for ``tags``.

``render_card(content, repo_id, base_url)`` is the model page: the markdown body as HTML
(markdown-it, CommonMark + tables), relative image links resolved against the repo's files.
"""

from __future__ import annotations

import re

# https://huggingface.co/docs/hub/repositories-licenses (hub-docs, "region licenses")
HUB_LICENSES = frozenset("""
apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0
bigcode-openrail-m afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc
cc0-1.0 cc-by-2.0 cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0
cc-by-nc-4.0 cc-by-nd-4.0 cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0
cdla-sharing-1.0 cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1
agpl-3.0 gfdl gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc lppl-1.3c ms-pl mpl-2.0 odc-by odbl openrail++
osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr deepfloyd-if-license llama2 llama3 llama3.1
llama3.2 llama3.3 gemma unknown other
""".split())
BASE_MODEL_RELATIONS = frozenset({"adapter", "merge", "quantized", "finetune"})
PIPELINE_TAGS = frozenset({"text-generation", "text2text-generation", "text-classification", "token-classification",
                           "question-answering", "summarization", "translation", "fill-mask", "feature-extraction",
                           "sentence-similarity", "image-text-to-text", "conversational"})
_FRONT_MATTER = re.compile(r"^(\s*---[\r\n]+)([\S\s]*?)([\r\n]+---(\r\n|\n|$))")


def split_card(content: str) -> tuple[str | None, str]:
    """(front matter text or None, markdown body), as huggingface_hub's RepoCard splits a card."""
    match = _FRONT_MATTER.search(content)
    if not match:
        return None, content
    return match.group(2), content[match.end():]


def _repo_ids(field: str, value, errors: list[str]) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, str):
            errors.append(f"{field}: {v!r} is not a string")
            continue
        try:
            validate_repo_id(v)
        except HFValidationError as e:
            errors.append(f"{field}: {v!r} is not a valid repo id ({e})")


def validate_card(content: str, repo_type: str = "model") -> tuple[list[str], list[str]]:
    """(errors, warnings) for a README.md, as the Hub's validate-yaml endpoint reports them."""
    import yaml
    from huggingface_hub import ModelCardData

    head, _ = split_card(content)
    if head is None:
        return [], ["empty or missing yaml metadata in repo card"]
    try:
        data = yaml.safe_load(head)
    except yaml.YAMLError as e:
        return [f"invalid YAML: {e}"], []
    if data is None:
        return [], ["empty or missing yaml metadata in repo card"]
    if not isinstance(data, dict):
        return [f"metadata must be a mapping, got {type(data).__name__}"], []
    errors: list[str] = []
    if repo_type == "model":
        try:
            ModelCardData(**data)
        except Exception as e:  # noqa: BLE001 - any construction error is a validation error
            errors.append(f"card data: {type(e).__name__}: {e}")
    lic = data.get("license")
    if lic is not None:
        for one in lic if isinstance(lic, list) else [lic]:
            if one not in HUB_LICENSES:
                errors.append(f"license: {one!r} is not a license id the Hub knows")
        if lic == "other" and not data.get("license_name"):
            errors.append("license: 'other' needs license_name")
    if "base_model" in data:
        _repo_ids("base_model", data["base_model"], errors)
    relation = data.get("base_model_relation")
    if relation is not None:
        if relation not in BASE_MODEL_RELATIONS:
            errors.append(f"base_model_relation: {relation!r} not in {sorted(BASE_MODEL_RELATIONS)}")
        if "base_model" not in data:
            errors.append("base_model_relation needs base_model")
    if "datasets" in data:
        _repo_ids("datasets", data["datasets"], errors)
    tags = data.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        errors.append("tags: must be a list of strings")
    tag = data.get("pipeline_tag")
    if tag is not None and tag not in PIPELINE_TAGS:
        errors.append(f"pipeline_tag: {tag!r} is not a known task")
    for key in ("library_name", "license_name", "license_link"):
        if key in data and not isinstance(data[key], str):
            errors.append(f"{key}: must be a string")
    return errors, []


def render_card(content: str, repo_id: str, base_url: str) -> str:
    """The repo's page: the card body as HTML; relative links point into the repo's files."""
    from markdown_it import MarkdownIt

    _, body = split_card(content)
    html = MarkdownIt("commonmark").enable("table").render(body)

    def resolve(match: re.Match) -> str:
        attr, url = match.group(1), match.group(2)
        if re.match(r"^[a-z]+:|^/|^#", url):
            return match.group(0)
        return f'{attr}="{base_url}/{repo_id}/resolve/main/{url}"'

    html = re.sub(r'(src|href)="([^"]*)"', resolve, html)
    return f"<!doctype html><html><head><title>{repo_id}</title></head><body>{html}</body></html>"


def links(html: str) -> list[tuple[str, str]]:
    """(tag attribute, URL) of every link and image in a rendered page."""
    return re.findall(r'(src|href)="([^"]*)"', html)
