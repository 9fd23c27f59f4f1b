"""backends: how rollouts are produced. The training loop every backend shares (loop.py: Backend),
the backends by name (registry.py), what they share in the config (settings.py) and the memory a
config needs (memory.py); mono/ (MonoBeast: actor processes and shared memory) and poly/
(PolyBeast: central inference behind a gRPC server that env clients connect to).

May import: errors, env, agent, learning, logs, run.
"""
