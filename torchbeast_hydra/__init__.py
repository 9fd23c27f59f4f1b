"""torchbeast_hydra: IMPALA (V-trace actor-critic) after TorchBeast, as a Hydra-configured harness.

The packages, what each may import, and the path of a batch through them: docs/architecture.md.
Each sub-package's __init__ lists its modules and the packages it may import.
"""

__version__ = "0.1.0"
