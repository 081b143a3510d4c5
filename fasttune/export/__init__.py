"""Export and the Hub: the LoRA adapter, merged 16-bit weights, GGUF files, model cards and the push.

A room above ``model_patches`` (it reads the families table for GGUF architectures) and
``hub_cards`` (card templates), below ``hf_integration``: nothing here knows the Trainer. Every
file is written atomically (``atomic.py``); the live model is never modified.
"""
