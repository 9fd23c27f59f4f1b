"""Moved to torchbeast_hydra.agent.models: the bodies (AtariNetBody, ResNetBody, MLPBody), Body.

This path keeps model targets and imports written before the move working, checkpoints saved by
earlier releases among them. Remove in 0.3."""

from torchbeast_hydra.agent.models import *  # noqa: F403
