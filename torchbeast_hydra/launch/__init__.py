"""launch: how runs are started. Hydra's job callbacks, sweep job dirs, the checks before a SLURM
sweep submits and the preemption hand-over (jobs.py), data-parallel ranks on torch.distributed
(distributed.py). settings.py: the distributed config.

May import: errors, env, agent, learning, logs, run, evaluation, backends.
"""
