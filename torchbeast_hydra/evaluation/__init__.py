"""evaluation: a trained policy plays whole episodes. Evaluation during training (periodic.py:
Evaluations, handed to the TrainingRun by the command), mode=test (evaluate.py: evaluate_all, play),
a checkpoint's policy for notebooks (policy.py: load_policy). settings.py: the eval and test config.

May import: errors, env, agent, learning, logs, run.
"""
