"""run: one training run from start to stop. The run's state: the learner, resume, checkpoints and
stats (training_run.py, resume.py, checkpoint.py), weights published to the acting policy
(publish.py), actor processes and their restarts (supervision.py), signals, seeding, devices, and
the learner threads' trial against the cores (thread_trial.py). settings.py: the run's own checks.

May import: errors, env, agent, learning, logs.
"""
