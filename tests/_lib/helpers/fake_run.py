"""A finished run folder without training: what `fasttune export` and `fasttune push` start from.

The run config names the embedded base; ``final/`` holds a LoRA adapter with non-zero B matrices
(so merging changes the weights) and the tokenizer; ``trainer_state.json`` a short loss curve and
``metrics.json`` a held-out exact match. Building it takes a second, not a training run.
"""

from __future__ import annotations

import json
from pathlib import Path


def make_finished_run(run_dir: Path, **fast) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model

    from fasttune.run.config import RunConfig
    from fasttune.run.finished import base_path
    from fasttune.run.folder import RunFolder

    cfg = RunConfig.from_dict({"run_name": "demo", "model": {"base": "embedded", "dtype": "float32"},
                               "lora": {"r": 4, "alpha": 8}, "fast": {"gguf_quantizations": ["q8_0"], **fast},
                               "training": {"max_steps": 4, "learning_rate": 1e-3, "seed": 3}})
    folder = RunFolder(run_dir)
    folder.start(cfg)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = base_path(cfg, folder)  # builds the embedded base under base/
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    model.save_pretrained(str(folder.final))
    AutoTokenizer.from_pretrained(base).save_pretrained(str(folder.final))
    history = [{"loss": 4.0 - i, "step": i + 1} for i in range(4)] + [{"eval_loss": 1.25, "step": 4}]
    folder.trainer_state.write_text(json.dumps({"global_step": 4, "log_history": history}))
    folder.write_metrics({"global_step": 4, "exact_match": 0.875})
    folder.write_state(status="completed", step=4)
    return Path(run_dir)
