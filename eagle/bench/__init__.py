"""The benchmark harness: decoding methods by name (`methods`), the benchmark (`benchmark`),
eval prompts (`evalsets`), round timing at a model shape (`timing`), the tree search
(`tree_search`) and the feature-error analysis behind the notebook (`analysis`)."""
