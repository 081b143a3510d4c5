"""Trainer, TRL and accelerate glue: FastTrainer, FastPatchCallback, the Fast*Trainers, load_model, multi-GPU.

The only place that knows the Trainer; export and the Hub live in ``fasttune/export/``.
"""
