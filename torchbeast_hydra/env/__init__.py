"""env: from an env id to arrays. Id lookup and hints (make.py, with the families' table in
families.py), Atari's preprocessing, the observation's leaves and the action space (spaces.py,
actions.py), the rollout layout derived from them (layout.py), and envs stepped in lockstep
(vector.py; ale-py's native vector env: native.py; EnvPool's: pool.py; env.engine's choice among
them: engines.py). settings.py: the env config group.

May import: errors only. Nothing here knows about models, learning or backends.
"""
