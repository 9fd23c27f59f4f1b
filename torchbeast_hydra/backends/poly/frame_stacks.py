"""Newest frames only: a stack of frames crosses the wire one frame at a time.

An Atari observation is the last 4 screens, so 3 of every 4 frames a client sends the server
already has. A client whose observation is a stack of frames (one array, frames along its first
axis) sends each env's newest frame alone when the rest of its stack is what it sent for that env
the step before, and its whole stack otherwise (an episode's first step, or an env whose frames do
not shift); the server rebuilds the stacks from the last ones it received. The test is equality,
not an assumption about the env, so the server's stacks are always exactly the client's. Each end
keeps the last stacks of one stream: both start empty with each stream (a reconnect sends whole
stacks again).
"""

from __future__ import annotations

import numpy as np


class StackError(ValueError):
    """Newest frames the receiver cannot place; the text says why."""


def stackable(spec) -> bool:
    """Whether spec's observation (envs.EnvSpec) is one array of two or more frames of 2+ dims each."""
    if not spec.single:
        return False
    shape = spec.leaves[0].shape
    return len(shape) >= 3 and shape[0] >= 2


class StackSender:
    """The client's end: splits each step's stacks into whole ones and newest frames."""

    def __init__(self):
        self.sent_tail = None  # the last step's stacks less their oldest frame, [num_envs, frames - 1, ...]

    def split(self, stacks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(newest_only [num_envs] bool, the whole stacks of the other envs, the newest frames of those)."""
        if self.sent_tail is None:
            newest_only = np.zeros(len(stacks), dtype=bool)
        else:
            newest_only = (stacks[:, :-1] == self.sent_tail).reshape(len(stacks), -1).all(axis=1)
        # A copy of what the next step compares with: an env may write its next stacks into this buffer.
        self.sent_tail = stacks[:, 1:].copy()
        if newest_only.all():
            return newest_only, stacks[:0], stacks[:, -1]
        if not newest_only.any():
            return newest_only, stacks, stacks[:0, -1]
        return newest_only, stacks[~newest_only], stacks[newest_only, -1]


class StackReceiver:
    """The server's end: rebuilds each step's stacks from whole ones and newest frames."""

    def __init__(self):
        self.last = None  # the stacks of the last step

    def keep(self, stacks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """A step whose stacks came whole (copied into out, if given)."""
        if out is not None:
            out[...] = stacks
            stacks = out
        self.last = stacks
        return stacks

    def join(
        self, newest_only: np.ndarray, whole: np.ndarray, newest: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The step's stacks [num_envs, frames, ...]. whole [envs not newest_only, frames, ...] and
        newest [envs newest_only, ...]: their shapes and dtypes are the caller's to check (wire.py).
        out: where to build them (the step's row of its unrolls, so that nothing copies them again;
        never the last step's memory), else a new array."""
        if not newest_only.any():
            return self.keep(whole, out)
        if self.last is None:
            raise StackError(
                "newest frames came before any whole stack of frames (a stream's first step sends them whole)"
            )
        stacks = np.empty((len(newest_only), *whole.shape[1:]), whole.dtype) if out is None else out
        if newest_only.all():
            stacks[:, :-1] = self.last[:, 1:]
            stacks[:, -1] = newest
        else:
            stacks[~newest_only] = whole
            stacks[newest_only, :-1] = self.last[newest_only, 1:]
            stacks[newest_only, -1] = newest
        self.last = stacks
        return stacks
