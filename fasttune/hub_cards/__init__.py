"""Model cards for the Hub: Jinja2 templates and one render function (no network, no ML imports)."""

from .render import CARD_KINDS, detect_chat_format, render_card

__all__ = ["CARD_KINDS", "detect_chat_format", "render_card"]
