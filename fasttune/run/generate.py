"""Try a finished run's model: greedy generation from a prompt (the Space's "try it" box).

The prompt is tokenized the way TRL tokenized the training rows: as plain text for prompt/completion
and text data, through the chat template (a user turn, then the generation prompt) for chat data
(the run's state records its data columns). The model loads once per run folder and stays cached
until another run (or a newer ``final/``) is asked for.
"""

from __future__ import annotations

import threading
from pathlib import Path

from .folder import RunFolder


class RunGenerator:
    """Generates with the model of a finished run; ``__call__(run_dir, prompt)`` → the completion text."""

    def __init__(self, max_new_tokens: int = 32) -> None:
        self.max_new_tokens = max_new_tokens
        self._key: tuple[str, int] | None = None
        self._loaded = None
        self._lock = threading.Lock()  # one generation at a time: the model is shared

    def _load(self, run_dir: Path):
        folder = RunFolder(run_dir)
        folder.require_finished()
        key = (str(folder.path.resolve()), folder.final.stat().st_mtime_ns)
        if key != self._key:
            from .runner import load_run

            self._loaded = None  # free the previous model first
            _, model, tok = load_run(folder.path)
            model.eval()
            chat = "messages" in (folder.read_state().get("data_columns") or []) and bool(tok.chat_template)
            self._loaded, self._key = (model, tok, chat), key
        return self._loaded

    def __call__(self, run_dir: str | Path, prompt: str, max_new_tokens: int | None = None) -> str:
        """The greedy completion of ``prompt`` (special tokens dropped).

        Raises:
            FileNotFoundError: ``run_dir`` is not a finished run.
            ValueError: the prompt is empty.
        """
        import torch

        if not prompt or not prompt.strip():
            raise ValueError("prompt: type something for the model to complete")
        with self._lock:
            model, tok, chat = self._load(Path(run_dir))
            if chat:
                text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
                enc = tok(text, return_tensors="pt", add_special_tokens=False)
            else:
                enc = tok(prompt, return_tensors="pt")
            limit = getattr(model.config, "max_position_embeddings", None) or 10**9
            room = limit - enc["input_ids"].shape[1]
            if room <= 0:
                raise ValueError(f"prompt: {enc['input_ids'].shape[1]} tokens leave no room in the model's "
                                 f"{limit}-token context")
            new = min(max_new_tokens or self.max_new_tokens, room)
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            with torch.no_grad():
                out = model.generate(**enc.to(model.device), max_new_tokens=new, do_sample=False, pad_token_id=pad)
            return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
