"""EAGLE-1 speculative decoding: a library (no hydra here; entry points live at the repo root)."""

__version__ = "0.1.0"
