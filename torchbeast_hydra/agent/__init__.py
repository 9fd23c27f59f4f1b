"""agent: the policy. Model bodies on the shared actor-critic core (models.py), encoders for
Dict/Tuple observations (encoders.py), the action space's distribution (distributions.py).
settings.py: the model config group.

May import: errors, env.
"""
