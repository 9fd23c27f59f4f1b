"""Population-based training (Jaderberg et al. 2017) as a Hydra multirun.

The members of a population are the jobs of one multirun (pbt.member=0..N-1), on any launcher.
They never talk to each other: each publishes its score and a checkpoint to the population's dir
every pbt.interval_steps (population.py: atomic files, a lineage table appended under a file lock),
and a member in the bottom fraction copies a top member's latest checkpoint and perturbs its
hyperparameters (member.py, mutation.py). No barrier: a slow, dead or preempted member holds
nobody up. settings.py holds the `pbt` group's schema and checks.

Imports: the run (run/), the learner's LIVE_KEYS (learning/); nothing below imports this package
but __main__, which attaches a Member to the training run.
"""
