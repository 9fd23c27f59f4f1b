"""learning: the learning math. V-trace targets (vtrace.py, the IMPALA reference API), the named
loss terms and one optimisation step (learner.py), how stale a batch's behaviour policy is (policy_lag.py),
GPU/CPU speed options (accel.py).
settings.py: the vtrace and optim config groups and accel.

May import: errors, env, agent.
"""
