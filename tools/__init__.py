"""Scripts run as modules from the repository root (``python -m tools.check_ring``,
``torchrun --nproc_per_node=2 -m tools.fuzz_ring``), so that they import ``tests.support``
and each other as packages."""
