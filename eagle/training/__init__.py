"""Training: the LightningModules (`lm`, `drafter`, `medusa` on the shared bases of `module`),
their DataModules (`datamodules`), the optimiser (`optim`), agreement metrics (`metrics`),
progress output (`progress`) and the one fit-and-export routine (`fit`).

This file imports nothing, so that `eagle.training.metrics` (pure tensor code) can be used
without loading Lightning.
"""
