"""What a mod means: its captured values, its traced graph and the graph's derivative,
ranges and fingerprints. Nothing here communicates (no torch.distributed)."""
