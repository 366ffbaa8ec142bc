"""Trained models on top of a frozen target: the EAGLE-1 drafter (`drafter`), Medusa-1 heads
(`medusa`), their checkpoints (`checkpoint`) and the formats other engines load (`export`)."""
