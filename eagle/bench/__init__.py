"""The benchmark harness: decoding methods by name (`methods`, built by `builder`), streamed
generation (`generate`), the benchmark (`benchmark`), eval prompts (`evalsets`), round timing at
a model shape (`timing`), the tree search (`tree_search`, run end to end by `machine_tree`),
the memory floor (`floor`), batch sizes (`batch`), the round's parts (`profile`), EAGLE-1's
ablations (`ablations`) and the feature-error analysis behind the notebook (`analysis`). A mode
of decode.py is one function of these modules, on plain values (coverage and export live with
their concepts: eagle.data.coverage, eagle.models.export)."""
