"""Moved to torchbeast_hydra.agent.encoders: MultiBody and NetHackBody.

This path keeps model targets and imports written before the move working, checkpoints saved by
earlier releases among them. Remove in 0.3."""

from torchbeast_hydra.agent.encoders import *  # noqa: F403
