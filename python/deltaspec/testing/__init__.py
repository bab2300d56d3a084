"""Helpers for deltaspec's own tests: tiny random Qwen3.5 checkpoints (needs torch + transformers)."""
