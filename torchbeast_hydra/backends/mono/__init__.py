"""MonoBeast: actor processes step envs and run a CPU copy of the policy; rollouts travel through
shared-memory buffers to learner threads (backend.py). settings.py: backend=mono's config.
"""
