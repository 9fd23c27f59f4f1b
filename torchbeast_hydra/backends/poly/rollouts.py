"""Unroll assembly for one client's envs, on the server, and the queue that hands them to the learner.

Rows follow the shared rollout layout (layout.py, learner.py): row t+1 holds an env's response to the
action chosen at row t, together with that action and the policy outputs that chose it, and
row 0 repeats the previous unroll's last row. An unroll is handed on when it has T steps, when
its env resets (with cut_at_reset) or when the client leaves; the last two are partial rollouts,
padded to T steps and masked.

Envs that finish together (a client's envs step in lockstep, so most do) are handed on in
chunks [T+1, k, ...] of up to chunk_size envs (the learner's batch size), each cut from the
client's rows in one copy; the learner takes its batches as column slices of the chunks, so a
batch that is one chunk costs no further copy. (Chunks no larger than a batch also keep each
allocation small enough for the C allocator to reuse freed memory rather than map fresh pages.)
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import numpy as np
import torch

from torchbeast_hydra.env.layout import AGENT_KEYS

# (rollouts [T+1, k, ...] tensors, each env's core state before row 0 [k, ...])
Emit = Callable[[dict, tuple], None]


class RolloutBuilder:
    def __init__(
        self,
        specs: dict,
        num_envs: int,
        unroll_length: int,
        initial_state: tuple,
        cut_at_reset: bool,
        emit: Emit,
        chunk_size: int = 1,
    ):
        """specs: rollout_specs(); initial_state: each env's core state, tensors [num_envs, ...]."""
        self.chunk_size = chunk_size
        self.unroll_length = unroll_length
        self.cut_at_reset = cut_at_reset
        self.emit = emit
        # An emitter that copies what it is given before it returns (a shard's: shards.SharedEmit)
        # gets views of the rows, which the builder then overwrites: one copy, not two.
        self.emit_takes_views = getattr(emit, "takes_views", False)
        self.envs = np.arange(num_envs)
        self.rows = {
            key: np.zeros((unroll_length + 1, num_envs, *shape), _numpy_dtype(dtype))
            for key, (shape, dtype) in specs.items()
            if key != "mask"
        }
        # ENV_KEYS, with the observation's leaves (layout.env_keys) in frame's place.
        self.env_keys = tuple(key for key in self.rows if key not in AGENT_KEYS)
        self.cursor = np.full(num_envs, -1)  # each env's last written row
        # The policy outputs that chose the envs' current actions; they go into the next row.
        self.agent = {key: np.zeros_like(self.rows[key][0]) for key in AGENT_KEYS}
        self.start_state = tuple(s.clone() for s in initial_state)
        self._times = np.arange(unroll_length + 1)[:, None]

    def add(self, env_outputs: dict, core_state: tuple) -> None:
        """Writes the envs' new outputs as a row; hands on the unrolls that end here.

        core_state: each env's state before it sees this row's frame, [num_envs, ...].
        """
        self.cursor += 1
        t = self.cursor
        if (t == t[0]).all():  # envs in step (the common case): a basic slice, no gather
            t0 = int(t[0])
            for key in self.env_keys:
                self.rows[key][t0] = env_outputs[key]
            for key in AGENT_KEYS:
                self.rows[key][t0] = self.agent[key]
        else:
            for key in self.env_keys:
                self.rows[key][t, self.envs] = env_outputs[key]
            for key in AGENT_KEYS:
                self.rows[key][t, self.envs] = self.agent[key]
        full = t == self.unroll_length
        if self.cut_at_reset:
            full |= env_outputs["episode_end"] & (t > 0)
        ending = np.flatnonzero(full)
        if len(ending):
            self._emit(ending)
            self._restart(ending, core_state)

    def set_agent_outputs(self, outputs: dict) -> None:
        """The policy's outputs for the row just added (numpy arrays [num_envs, ...])."""
        for key in AGENT_KEYS:
            self.agent[key][...] = outputs[key]

    def flush(self) -> int:
        """Hands on every env's unfinished unroll (the client is leaving); returns how many."""
        unfinished = np.flatnonzero(self.cursor >= 1)
        if len(unfinished):
            self._emit(unfinished)
        self.cursor[:] = -1
        return len(unfinished)

    def discard(self) -> int:
        """Forgets every env's unfinished unroll (its client was refused: none of it may reach the
        learner); returns how many there were."""
        unfinished = int((self.cursor >= 1).sum())
        self.cursor[:] = -1
        return unfinished

    def _emit(self, envs: np.ndarray) -> None:
        for first in range(0, len(envs), self.chunk_size):
            self._emit_chunk(envs[first : first + self.chunk_size])

    def _emit_chunk(self, envs: np.ndarray) -> None:
        a, b = int(envs[0]), int(envs[-1]) + 1
        if b - a == len(envs) and self.emit_takes_views:  # the emitter copies: views it is
            rollouts = {key: torch.from_numpy(rows[:, a:b]) for key, rows in self.rows.items()}
        elif b - a == len(envs):  # a run of envs: a plain slice (a view), copied once
            rollouts = {key: torch.from_numpy(rows[:, a:b].copy()) for key, rows in self.rows.items()}
        else:  # fancy indexing copies already
            rollouts = {key: torch.from_numpy(rows[:, envs]) for key, rows in self.rows.items()}
        index = torch.from_numpy(envs)
        rollouts["mask"] = torch.from_numpy(self._times <= self.cursor[envs])
        self.emit(rollouts, tuple(s[index] for s in self.start_state))

    def _restart(self, envs: np.ndarray, core_state: tuple) -> None:
        t = self.cursor[envs]
        for rows in self.rows.values():
            rows[0, envs] = rows[t, envs]
        self.cursor[envs] = 0
        index = torch.from_numpy(envs)
        for start, state in zip(self.start_state, core_state):
            start[index] = state[index]


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def width(rollouts: dict) -> int:
    return rollouts["mask"].shape[1]


class RolloutQueue:
    """Chunks of rollouts waiting for the learner, bounded in rollouts; hands out batches of B.

    put() waits while `capacity` rollouts are waiting (back-pressure on the server's sessions);
    a chunk always fits into an empty queue, so the bound is capacity plus one chunk.
    """

    def __init__(self, capacity: int, pin: bool = False):
        """pin: batches are assembled in pinned memory (bound for a GPU: no second staging copy)."""
        self.capacity = capacity
        self.pin = pin
        self._chunks = collections.deque()  # [rollouts, state, first column not yet taken, release]
        self._size = 0
        self._changed = threading.Condition()
        self.assembly_s = 0.0  # time the last get_batch spent cutting and joining

    def qsize(self) -> int:
        return self._size

    def put(self, rollouts: dict, state: tuple, stopping: threading.Event, release=None) -> None:
        """Queues a chunk; waits while the queue is full, unless stopping is set. release: the chunk's
        tensors are a server shard's slot (shards.py): get_batch copies what it takes of them, and
        calls release once it has taken all."""
        with self._changed:
            while self._size >= self.capacity and not stopping.is_set():
                self._changed.wait(timeout=0.5)
            if stopping.is_set():
                if release is not None:
                    release()
                return
            self._chunks.append([rollouts, state, 0, release])
            self._size += width(rollouts)
            self._changed.notify_all()

    def get_batch(self, batch_size: int, done: Callable[[], bool]):
        """B rollouts as (batch [T+1, B, ...], core state [layers, B, ...]); None once done()."""
        pieces = []
        needed = batch_size
        copying = 0.0  # seconds copying out of shards' slots
        with self._changed:
            while needed:
                while not self._chunks:
                    if done():
                        return None
                    self._changed.wait(timeout=0.2)
                chunk = self._chunks[0]
                rollouts, state, first, release = chunk
                take = min(needed, width(rollouts) - first)
                chunk[2] += take
                if release is None:
                    pieces.append((rollouts, state, first, first + take))
                else:  # a shard's slot: copied out at once, and given back once wholly taken
                    copy_started = time.perf_counter()
                    pieces.append((*_taken(rollouts, state, first, first + take, self.pin), 0, take))
                    copying += time.perf_counter() - copy_started
                if chunk[2] == width(rollouts):
                    self._chunks.popleft()
                    if release is not None:
                        release()
                self._size -= take
                needed -= take
            self._changed.notify_all()
        started = time.perf_counter()
        columns = [{key: value[:, a:b] for key, value in rollouts.items()} for rollouts, _, a, b in pieces]
        batch = _join(columns, 1, self.pin)
        states = _join([tuple(s[a:b] for s in state) for _, state, a, b in pieces], 0, False)
        result = batch, tuple(_copy(s.transpose(0, 1), self.pin) for s in states)
        self.assembly_s = time.perf_counter() - started + copying
        return result


def _taken(rollouts: dict, state: tuple, a: int, b: int, pin: bool) -> tuple:
    """Columns a:b of a chunk and their states, copied (into pinned memory if pin)."""
    taken = {key: _into(value[:, a:b], pin) for key, value in rollouts.items()}
    return taken, tuple(s[a:b].clone() for s in state)


def _into(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin).copy_(tensor)


def _join(parts: list, dim: int, pin: bool):
    """Concatenates dicts or tuples of tensors along dim; a single part is returned as it is (views),
    unless pin: then everything is copied once, into pinned memory (unless pinned already)."""
    if len(parts) == 1 and (not pin or _pinned(parts[0])):
        return parts[0]
    if isinstance(parts[0], dict):
        return {key: _cat([part[key] for part in parts], dim, pin) for key in parts[0]}
    return tuple(_cat(group, dim, pin) for group in zip(*parts))


def _cat(tensors: list, dim: int, pin: bool) -> torch.Tensor:
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.cat(tensors, dim, out=torch.empty(shape, dtype=tensors[0].dtype, pin_memory=pin))


def _pinned(part) -> bool:
    values = part.values() if isinstance(part, dict) else part
    return all(value.is_pinned() for value in values)


def _copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A contiguous copy, in pinned memory if pin."""
    if not pin:
        return tensor.contiguous()
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
