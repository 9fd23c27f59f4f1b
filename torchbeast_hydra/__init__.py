"""torchbeast_hydra: IMPALA (V-trace actor-critic) after TorchBeast, as a Hydra-configured harness."""

__version__ = "0.1.0"
