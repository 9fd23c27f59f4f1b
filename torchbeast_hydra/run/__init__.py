"""run: one training (or test) run from start to stop. The training loop both backends share
(training.py), the run's state: resume, checkpoints, stats (training_run.py, resume.py,
checkpoint.py), weights published to the acting policy (publish.py), actor processes and their
restarts (supervision.py), signals, seeding and devices, mode=test (evaluate.py), and Hydra's
launch callbacks for sweeps and SLURM (launch.py). settings.py: mode=test's settings.

May import: errors, env, agent, learning, logs.
"""
