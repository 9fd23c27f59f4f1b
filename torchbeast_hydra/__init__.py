"""torchbeast_hydra: IMPALA (V-trace actor-critic) after TorchBeast, as a Hydra-configured harness.

Reading order, following the data:

1. envs.py      an env (any gymnasium id; Atari preprocessed) and a few stepped in lockstep
   actions.py   the env's action space: its kind, the array an action is, its checks
   layout.py    the rollout layout: every key a rollout holds, with its shape and dtype
2. models.py    the policy: a body (obs -> features) on the shared actor-critic core
   distributions.py  the action space's distribution: sample, greedy, log-prob, entropy, KL
   encoders.py  bodies for Dict/Tuple observations: an encoder per leaf (multi), NetHack's (nethack)
   mono.py      the actors of MonoBeast: processes that act and fill shared-memory rollouts
   poly/        the actors of PolyBeast: env clients, the ActorPool server, central inference
   vector_envs.py  ale-py's native vector env, the same contract as envs.py, for poly clients
3. training.py  the training loop both backends share: learner threads, progress, clean stop
   training_run.py  the run's state: learner updates, resume (resume.py), checkpoints, stats
   learner.py   the learning math: named loss terms, one optimisation step
4. vtrace.py    V-trace targets (the IMPALA paper's reference API)

Around them: config.py (typed configs), __main__.py (the command), memory.py (the memory a config
needs, checked before anything starts), supervision.py (actor processes, replaced when they die),
signals.py (stopping cleanly), seeding.py and devices.py, publish.py (weights to the acting policy),
accel.py (GPU speed options), checkpoint.py, metrics.py, wandb_log.py and
tensorboard_log.py (where stats go), evaluate.py (mode=test), launch.py (sweeps and SLURM),
analysis/ (runs into pandas, plots, the plot command).
"""

__version__ = "0.1.0"
