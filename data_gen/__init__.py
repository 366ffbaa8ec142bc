"""Data builders: the built-in Python corpus, conversations, and target feature dumps."""
