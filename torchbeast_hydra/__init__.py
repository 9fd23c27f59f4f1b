"""torchbeast_hydra: IMPALA (V-trace actor-critic) after TorchBeast, as a Hydra-configured harness.

The packages follow the data, and each imports only from those above it in this list
(tests/test_module_imports.py keeps it so):

    errors.py   ConfigError: the one error a bad config raises, with what to change
    env/        an env id -> arrays: lookup and families, Atari preprocessing, the observation's
                leaves and the action space, the rollout layout, envs stepped in lockstep
    agent/      the policy: model bodies on the actor-critic core, encoders, action distributions
    learning/   V-trace, the named loss terms, one optimisation step, speed options
    logs/       the stats a run keeps, logs.csv, wandb, TensorBoard; reading runs back, plots
    run/        one run: the shared training loop, resume, checkpoints, signals, seeding,
                devices, actor supervision, mode=test, Hydra's launch callbacks
    backends/   how rollouts are made: mono/ (MonoBeast) and poly/ (PolyBeast)

On top: config.py (composes the packages' settings, refuses unknown keys, validates) and
__main__.py (the command). Each package's settings.py holds its slice of the config: its typed
schemas, checks and derived values.
"""

__version__ = "0.1.0"
