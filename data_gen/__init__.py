"""Data builders: the built-in Python corpus and its tokenizer, token samples (conversations,
plain text), and `python -m data_gen`, which dumps a target's features of them."""
