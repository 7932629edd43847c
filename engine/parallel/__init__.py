"""Multi-rank execution: EP/TP sharding, attention DP and context-parallel prefill (torch.distributed)."""
