"""The license of the base model, carried over to the cards of what was trained from it.

Looked up, first answer wins: the base folder's own README.md (a local base), the base's README.md
in the Hugging Face cache, then the Hub's card data for the base (one ``model_info`` call with a
deadline, skipped when HF_HUB_OFFLINE is set). Found nowhere, the license is unknown and the
cards say so ("unknown — check the base model's license") instead of guessing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

UNKNOWN_TEXT = "unknown — check the base model's license"


@dataclass(frozen=True)
class BaseLicense:
    """A Hub license id (``license``), with ``license_name``/``license_link`` for ``other``, and
    where it was found (``source``, in words). ``license`` None means unknown."""

    license: str | None = None
    name: str | None = None
    link: str | None = None
    source: str | None = None

    @property
    def text(self) -> str:
        """What the card prints."""
        if not self.license:
            return UNKNOWN_TEXT
        label = self.name if self.license == "other" and self.name else self.license
        return f"{label} ({self.source})" if self.source else label

    def front_matter(self) -> dict[str, str]:
        """The card's ``license``/``license_name``/``license_link`` keys ({} when unknown)."""
        if not self.license:
            return {}
        out = {"license": self.license}
        if self.name:
            out["license_name"] = self.name
        if self.link:
            out["license_link"] = self.link
        return out


def from_card_data(data: dict | None, source: str) -> BaseLicense | None:
    """The license in a card's metadata (None when it names none)."""
    if not isinstance(data, dict):
        return None
    lic = data.get("license")
    if isinstance(lic, list):
        lic = lic[0] if len(lic) == 1 else None
    if not isinstance(lic, str) or not lic.strip():
        return None
    name, link = data.get("license_name"), data.get("license_link")
    return BaseLicense(lic.strip(), name if isinstance(name, str) else None,
                       link if isinstance(link, str) else None, source)


def _from_readme(path: Path, source: str) -> BaseLicense | None:
    if not path.is_file():
        return None
    try:
        from huggingface_hub import metadata_load

        return from_card_data(metadata_load(path), source)
    except Exception as e:  # noqa: BLE001 - a malformed card is no license, not a failed export
        logger.info("could not read the license in %s: %s", path, e)
        return None


def find_base_license(base_model_id: str | None, local_dir: str | Path | None = None, *,
                      timeout: float = 10.0) -> BaseLicense:
    """The base model's license: from ``local_dir``'s README.md, the cached card of ``base_model_id``,
    or the Hub (``timeout`` s, never when offline). Unknown when none answers."""
    if local_dir is not None:
        found = _from_readme(Path(local_dir) / "README.md", "from the base model's card")
        if found:
            return found
    if not base_model_id:
        return BaseLicense()
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(base_model_id, "README.md")
    except Exception:  # noqa: BLE001 - an invalid id or an unreadable cache: nothing cached
        cached = None
    if isinstance(cached, str):
        found = _from_readme(Path(cached), f"from the card of {base_model_id}")
        if found:
            return found
    from .hub_preflight import offline

    if offline():
        return BaseLicense()
    try:
        from huggingface_hub import HfApi

        from .hub_http import hub_timeouts

        with hub_timeouts(connect=timeout, stall=timeout):
            info = HfApi().model_info(base_model_id, timeout=timeout)
        data = info.card_data.to_dict() if info.card_data is not None else None
        return from_card_data(data, f"from the card of {base_model_id}") or BaseLicense()
    except Exception as e:  # noqa: BLE001 - no answer: the cards say the license is unknown
        logger.info("license of %s not found on the Hub: %s", base_model_id, type(e).__name__)
        return BaseLicense()
