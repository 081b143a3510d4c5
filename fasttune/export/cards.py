"""Model cards of a finished run: README.md, the loss-curve PNG and, for GGUF, an Ollama Modelfile.

Rendered by ``hub_cards`` (templates, no network) from ``CardFacts`` (base, license, data, method,
hyperparameters, held-out results) and the run's statistics (``run_stats_from_state``), and
written atomically into each artifact folder by export, so a push only uploads them. Before the
repo ids are known (no ``hub_model_id`` with a namespace) the cards name
``your-hf-username/<name>`` and say so; ``.fasttune-card.json`` records which ids a folder's cards
were rendered for, and a push re-renders them only when it pushes elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from .artifacts import hub_repos
from .atomic import atomic_write
from .card_facts import CardFacts

PLACEHOLDER_NAMESPACE = "your-hf-username"
CARD_STAMP = ".fasttune-card.json"


def run_stats_from_state(state) -> dict[str, Any]:
    """Steps, final loss, tokens/s, peak memory, runtime and the loss curve from a ``TrainerState``.

    Reads ``log_history`` keys "loss", "tokens_per_second" and "peak_memory_gib" (logged by
    FastTrainer), "train_runtime" and "train_loss" (the Trainer's summary).
    """
    history = list(getattr(state, "log_history", None) or [])
    curve = [(int(h.get("step", i)), float(h["loss"])) for i, h in enumerate(history) if "loss" in h]

    def last(key):
        return next((h[key] for h in reversed(history) if key in h), None)

    peaks = [h["peak_memory_gib"] for h in history if "peak_memory_gib" in h]
    final_loss = curve[-1][1] if curve else last("train_loss")
    return {"global_step": getattr(state, "global_step", None), "final_loss": final_loss,
            "tokens_per_second": last("tokens_per_second"), "peak_memory_gib": max(peaks) if peaks else None,
            "train_runtime": last("train_runtime"), "loss_curve": curve}


def write_loss_curve(points: Sequence[tuple[int, float]], path: Path) -> str | None:
    """Writes a PNG of the loss curve; returns None, or why no image was written."""
    if len(points) < 2:
        return "Loss curve not shown: fewer than two logged losses."
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return "Loss curve not shown: matplotlib is not installed."
    import io

    fig = Figure(figsize=(6, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([p[0] for p in points], [p[1] for p in points], color="#3b6fb6", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    atomic_write(path, buf.getvalue())
    return None


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


_HEADLINE_QUANTS = ("Q8_0", "Q4_K_M", "Q6_K", "Q5_K_M")


def _quant_of(path: Path) -> str:
    stem = path.stem
    for q in sorted(("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M",
                     "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"), key=len, reverse=True):
        if stem.endswith("-" + q):
            return q
    return stem.rsplit("-", 1)[-1]


def _gguf_rank(path: Path) -> tuple:
    q = _quant_of(path)
    return (_HEADLINE_QUANTS.index(q) if q in _HEADLINE_QUANTS else len(_HEADLINE_QUANTS), path.name)


def card_repos(repo_id: str | None, name: str, kinds) -> tuple[dict[str, str], bool]:
    """(kind → repo id, published) for cards written before a push: the real ids when ``repo_id``
    has a namespace, else ``your-hf-username/<repo_id or name>`` placeholders."""
    if repo_id and "/" in repo_id:
        return hub_repos(repo_id, kinds), True
    return hub_repos(f"{PLACEHOLDER_NAMESPACE}/{repo_id or name}", kinds), False


def headline_gguf(folder: Path) -> Path | None:
    """The GGUF file usage snippets show first (Q8_0, then Q4_K_M, ...), None when there is none."""
    files = sorted(Path(folder).glob("*.gguf"), key=_gguf_rank)
    files = [f for f in files if not f.name.startswith((".", "mmproj-"))]  # the vision file is never the model
    return files[0] if files else None


def cards_match(folders: dict[str, Path], repos: dict[str, str]) -> bool:
    """Every folder has a README.md rendered for exactly ``repos`` (as published repo ids)."""
    for folder in folders.values():
        try:
            stamp = json.loads((Path(folder) / CARD_STAMP).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not (Path(folder) / "README.md").is_file() or stamp != {"repos": repos, "published": True}:
            return False
    return True


def write_cards(folders: dict[str, Path], repos: dict[str, str], *, tokenizer=None, run_stats=None,
                fast_config=None, base_model_id=None, datasets=None, endpoint: str | None = None,
                lora: bool = True, facts: CardFacts | None = None, published: bool = True) -> None:
    """README.md (+ loss_curve.png, + Modelfile for GGUF) in each artifact folder.

    Args:
        folders: artifact kind → its folder. repos: kind → repo id the cards name.
        facts: what the cards state; without it, one is built from ``base_model_id``, ``datasets``
            and ``run_stats`` (the older keyword arguments).
        lora: the run trained adapters (the merged card then says they were merged) or all weights.
        published: False while ``repos`` are placeholders.
    """
    from ..hub_cards import render_card

    if endpoint is None:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    if facts is None:
        facts = CardFacts(base_model_id=base_model_id, datasets=list(datasets or []), stats=dict(run_stats or {}))
    stats = dict(facts.stats or run_stats or {})
    curve = stats.pop("loss_curve", None) or []
    config = fast_config.to_dict() if hasattr(fast_config, "to_dict") else fast_config
    headline = headline_gguf(folders["gguf"]) if "gguf" in folders else None
    for kind, folder in folders.items():
        note = write_loss_curve(curve, folder / "loss_curve.png") if curve else "No training log available."
        ctx = dict(facts.context(), repo_id=repos[kind], repos=repos, endpoint=endpoint, stats=stats,
                   fast_config=config, loss_curve=None if note else "loss_curve.png", loss_curve_note=note,
                   chat_template=getattr(tokenizer, "chat_template", None), lora=lora, published=published,
                   gguf_quant=_quant_of(headline) if headline else "Q8_0")
        if kind == "gguf":
            files = sorted((f for f in folder.glob("*.gguf") if not f.name.startswith((".", "mmproj-"))),
                           key=_gguf_rank)
            ctx["gguf_files"] = [{"file": f.name, "quant": _quant_of(f), "size": _human(f.stat().st_size)}
                                 for f in files]
            ctx["mmproj_files"] = [{"file": f.name, "size": _human(f.stat().st_size)}
                                   for f in sorted(folder.glob("mmproj-*.gguf"))]
            if files:
                ctx["modelfile_gguf"] = files[0].name
                atomic_write(folder / "Modelfile", render_card("modelfile", **ctx))
        atomic_write(folder / "README.md", render_card(kind, **ctx))
        atomic_write(folder / CARD_STAMP, json.dumps({"repos": repos, "published": published}, sort_keys=True))
