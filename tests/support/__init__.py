"""What the tests share: the multi-process harness (``harness.run_world``), the fp64 oracle
(``oracle.attention``), the test matrix of mods (``cases``), the ring's error by world size
(``numerics``), random ring calls (``random_calls``) and a CPU stand-in for the cuDNN frontend
(``emulated_cudnn``). The tests import it as ``support`` (``tests/conftest.py``); the tools
run from the repository root import it as ``tests.support``."""
