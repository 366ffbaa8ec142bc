"""Data builders: token samples (conversations, plain text, self-distilled rows), and
`python -m data_gen`, which dumps a target's features of them."""
