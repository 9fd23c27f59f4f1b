"""Unroll assembly for one client's envs, on the server.

Rows follow the shared rollout layout (layout.py, learner.py): row t+1 holds an env's response to the
action chosen at row t, together with that action and the policy outputs that chose it, and
row 0 repeats the previous unroll's last row. An unroll is handed on when it has T steps, when
its env resets (with cut_at_reset) or when the client leaves; the last two are partial rollouts,
padded to T steps and masked.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..layout import AGENT_KEYS, ENV_KEYS

Emit = Callable[[dict, tuple], None]  # (rollout [T+1, ...] tensors, core state before row 0)


class RolloutBuilder:
    def __init__(
        self, specs: dict, num_envs: int, unroll_length: int, initial_state: tuple, cut_at_reset: bool, emit: Emit
    ):
        """specs: rollout_specs(); initial_state: each env's core state, tensors [num_envs, ...]."""
        self.unroll_length = unroll_length
        self.cut_at_reset = cut_at_reset
        self.emit = emit
        self.envs = np.arange(num_envs)
        self.rows = {
            key: np.zeros((unroll_length + 1, num_envs, *shape), _numpy_dtype(dtype))
            for key, (shape, dtype) in specs.items()
            if key != "mask"
        }
        self.cursor = np.full(num_envs, -1)  # each env's last written row
        # The policy outputs that chose the envs' current actions; they go into the next row.
        self.agent = {key: np.zeros_like(self.rows[key][0]) for key in AGENT_KEYS}
        self.start_state = tuple(s.clone() for s in initial_state)

    def add(self, env_outputs: dict, core_state: tuple) -> None:
        """Writes the envs' new outputs as a row; hands on the unrolls that end here.

        core_state: each env's state before it sees this row's frame, [num_envs, ...].
        """
        self.cursor += 1
        t = self.cursor
        for key in ENV_KEYS:
            self.rows[key][t, self.envs] = env_outputs[key]
        for key in AGENT_KEYS:
            self.rows[key][t, self.envs] = self.agent[key]
        full = t == self.unroll_length
        if self.cut_at_reset:
            full |= env_outputs["episode_end"] & (t > 0)
        for i in np.flatnonzero(full):
            self._emit(i)
            self._restart(i, core_state)

    def set_agent_outputs(self, outputs: dict) -> None:
        """The policy's outputs for the row just added (numpy arrays [num_envs, ...])."""
        for key in AGENT_KEYS:
            self.agent[key][...] = outputs[key]

    def flush(self) -> int:
        """Hands on every env's unfinished unroll (the client is leaving); returns how many."""
        unfinished = np.flatnonzero(self.cursor >= 1)
        for i in unfinished:
            self._emit(i)
        self.cursor[:] = -1
        return len(unfinished)

    def _emit(self, i: int) -> None:
        t = int(self.cursor[i])
        rollout = {key: torch.from_numpy(rows[:, i].copy()) for key, rows in self.rows.items()}
        rollout["mask"] = torch.arange(self.unroll_length + 1) <= t
        self.emit(rollout, tuple(s[i].clone() for s in self.start_state))

    def _restart(self, i: int, core_state: tuple) -> None:
        t = self.cursor[i]
        for rows in self.rows.values():
            rows[0, i] = rows[t, i]
        self.cursor[i] = 0
        for start, state in zip(self.start_state, core_state):
            start[i] = state[i]


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def stack_rollouts(items: list) -> tuple[dict, tuple]:
    """B (rollout, state) pairs -> a batch [T+1, B, ...] and core state [layers, B, ...]."""
    rollouts, states = zip(*items)
    batch = {key: torch.stack([r[key] for r in rollouts], dim=1) for key in rollouts[0]}
    core_state = tuple(torch.stack(parts, dim=1) for parts in zip(*states))
    return batch, core_state
