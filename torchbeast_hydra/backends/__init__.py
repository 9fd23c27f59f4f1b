"""backends: how rollouts are produced. mono/ (MonoBeast: actor processes and shared memory) and
poly/ (PolyBeast: central inference behind a gRPC server that env clients connect to); what both
share: their settings (settings.py) and the memory a config needs (memory.py).

May import: everything below it (errors, env, agent, learning, logs, run).
"""
