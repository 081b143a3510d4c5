"""Trainer, TRL, accelerate and Hub integration: the only place that knows them."""
