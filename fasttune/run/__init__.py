"""YAML runs behind ``fasttune train/export/push`` and the Space: the run config, its data and
sources, the run folder and its state, the runner, and the quickstart.

The top floor but for the CLI: it drives ``hf_integration`` (trainers, loader) and ``export``.
"""
