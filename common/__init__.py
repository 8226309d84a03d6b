"""Shared helpers for the training scripts in `scripts/`: flat functions, keyword arguments, no Trainer."""
