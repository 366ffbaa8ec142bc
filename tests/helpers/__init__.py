"""Helpers shared by the test modules (which never import each other): tiny models, decoding
references, statistics, composed configs."""
