"""Moved to torchbeast_hydra.learning.learner: LossInputs, for your own loss terms.

This path keeps model targets and imports written before the move working, checkpoints saved by
earlier releases among them. Remove in 0.3."""

from torchbeast_hydra.learning.learner import *  # noqa: F403
