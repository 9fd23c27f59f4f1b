"""Unroll assembly for one client's envs, on the server, and the queue that hands them to the learner.

Rows follow the shared rollout layout (layout.py, learner.py): row t+1 holds an env's response to the
action chosen at row t, together with that action and the policy outputs that chose it, and
row 0 repeats the previous unroll's last row.

A client's envs stay in step: every T steps all their unrolls end together and are handed on, in
chunks [T+1, k, ...] of up to chunk_size envs (the learner's batch size). Where chunk_size divides
the envs, the rows themselves are lent, no copy: the learner's queue hands a chunk out as a batch
as it is and gives the rows back for the builder to fill again. A local client (local.py) writes
its envs' outputs into the rows itself, in shared memory: the server copies no frame at all.

An env whose episode ends (cut_at_reset) is handed on at once, copied, as a partial rollout whose
mask marks its rows up to the reset; it goes on in step, and the unroll it ends at row T marks
only the rows after its reset (the learner reads masked rows as padding, whether they come before
or after the real ones). A client that leaves hands on its envs' unfinished rows likewise, as
partial rollouts.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Collection

import numpy as np
import torch

from torchbeast_hydra.env.layout import AGENT_KEYS

# (rollouts [T+1, k, ...] tensors, each env's core state before row 0 [k, ...]); an emitter with
# takes_buffers = True is also passed, for rows lent to it, the release to call when done with them.
Emit = Callable[..., None]


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
        buffers: list | None = None,
    ):
        """specs: rollout_specs(); initial_state: each env's core state, tensors [num_envs, ...];
        buffers: the rows to fill, in turn, instead of fresh ones (row_layout's, in shared memory:
        a local client writes its envs' outputs there itself); when none is free to go on in, the
        finished rows are copied out instead of lent."""
        self.chunk_size = chunk_size
        self.unroll_length = unroll_length
        self.cut_at_reset = cut_at_reset
        self.emit = emit
        # An emitter that copies what it is given before it returns (a shard's: shards.SharedEmit)
        # gets views of the rows, which the builder then overwrites: one copy, not two.
        self.emit_takes_views = getattr(emit, "takes_views", False)
        # The rows are [T+1, N, ...]; the envs in G groups of W columns. W is chunk_size where it
        # divides the envs: each group's columns are then a whole chunk, and an emitter that takes
        # buffers (emit(rollouts, state, release): the learner's queue) is lent them as they are,
        # while the builder goes on in rows given back by release, or fresh ones. No copy.
        self.width = chunk_size if num_envs % chunk_size == 0 else num_envs
        self.groups = num_envs // self.width
        self.lends = lends(emit, num_envs, chunk_size)
        self.layout = row_layout(specs, num_envs, unroll_length)
        self.buffers = buffers
        # Lent rows back from the emitter (appended from the learner's thread), or buffers not yet used.
        self._given_back = list(reversed(buffers[1:])) if buffers else []
        self.rows = buffers[0] if buffers else self._blank_rows()
        # ENV_KEYS, with the observation's leaves (layout.env_keys) in frame's place.
        self.env_keys = tuple(key for key in self.rows if key not in AGENT_KEYS)
        self.envs = np.arange(num_envs)
        self.t = -1  # the last row written: the envs stay in step, resets or not
        # The row each env's current segment starts from: 0, or the row its episode last reset at
        # (cut_at_reset): the rows up to it were handed on already, as a partial rollout.
        self.start = np.zeros(num_envs, np.int64)
        # The policy outputs that chose the envs' current actions; they go into the next row.
        self.agent = {key: np.zeros((num_envs, *self.layout[key][0][2:]), self.layout[key][1]) for key in AGENT_KEYS}
        self.start_state = tuple(s.clone() for s in initial_state)
        self._times = np.arange(unroll_length + 1)[:, None]

    def next_row(self) -> tuple[int, int]:
        """(which of buffers, row): where the envs' next outputs go."""
        return next(i for i, rows in enumerate(self.buffers) if rows is self.rows), self.t + 1

    def row_ahead(self, key: str) -> np.ndarray:
        """key's row [num_envs, ...] that the envs' next outputs go to: a view to write them into."""
        return self.rows[key][self.t + 1]

    def add(self, env_outputs: dict, core_state: tuple, written: Collection[str] = ()) -> None:
        """Writes the envs' new outputs as a row (but the keys written there already: row_ahead's,
        next_row's); hands on the unrolls that end here.

        core_state: each env's state before it sees this row's frame, [num_envs, ...].
        """
        self.t += 1
        t = self.t
        for key in self.env_keys:
            if key not in written:
                self.rows[key][t] = env_outputs[key]
        for key in AGENT_KEYS:
            self.rows[key][t] = self.agent[key]
        if t == self.unroll_length:
            self._end_unrolls(core_state)
        elif self.cut_at_reset and t > 0:
            resets = np.flatnonzero(env_outputs["episode_end"])
            if len(resets):  # partial rollouts: these envs' rows up to t; their next segments start at t
                self._emit(resets)
                self.start[resets] = t

    def set_agent_outputs(self, outputs: dict) -> None:
        """The policy's outputs for the row just added (numpy arrays [num_envs, ...])."""
        for key in AGENT_KEYS:
            self.agent[key][...] = outputs[key]

    def flush(self) -> int:
        """Hands on every env's unfinished unroll (the client is leaving); returns how many."""
        unfinished = np.flatnonzero(self.start < self.t)
        if len(unfinished):
            self._emit(unfinished)
        self._forget()
        return len(unfinished)

    def discard(self) -> int:
        """Forgets every env's unfinished unroll (its client was refused: none of it may reach the
        learner); returns how many there were."""
        unfinished = int((self.start < self.t).sum())
        self._forget()
        return unfinished

    def _forget(self) -> None:
        self.t = -1
        self.start[:] = 0

    def _blank_rows(self) -> dict | None:
        """Rows to go on in: given back, or fresh; None where the buffers are fixed and all out."""
        if self._given_back:
            return self._given_back.pop()
        if self.buffers:
            return None
        return {key: np.zeros(shape, dtype) for key, (shape, dtype) in self.layout.items()}

    def _end_unrolls(self, core_state: tuple) -> None:
        """Row T: every env's unroll ends. Handed on, lent whole where the emitter takes buffers
        (and there are rows to go on in); the next unrolls start from row T, in the state the envs
        are in now."""
        ended = self.rows
        fresh = self._blank_rows() if self.lends else None
        if fresh is not None:
            self.rows = fresh
            release = _Countdown(self.groups, lambda: self._given_back.append(ended))
            for g in range(self.groups):
                columns = slice(g * self.width, (g + 1) * self.width)
                rollouts = {key: torch.from_numpy(rows[:, columns]) for key, rows in ended.items()}
                self._emit_rollouts(rollouts, self.envs[columns], release)
        else:
            self._emit(self.envs)
        for key, rows in self.rows.items():
            rows[0] = ended[key][self.t]
        self.t = 0
        self.start[:] = 0
        for start, state in zip(self.start_state, core_state):
            start.copy_(state)

    def _emit(self, envs: np.ndarray) -> None:
        """Hands on these envs' unrolls, copied out of the rows, in chunks of at most chunk_size envs."""
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
        self._emit_rollouts(rollouts, envs)

    def _emit_rollouts(self, rollouts: dict, envs: np.ndarray, release=None) -> None:
        """With the mask: each env's real rows are those after its segment's start, up to now (row 0,
        which the learner reads only as the first row's predecessor, is marked too)."""
        mask = (self._times > self.start[envs]) & (self._times <= self.t)
        mask[0] = True
        rollouts["mask"] = torch.from_numpy(mask)
        index = torch.from_numpy(envs)
        state = tuple(s[index] for s in self.start_state)  # copies: start_state is overwritten next
        if release is None:
            self.emit(rollouts, state)
        else:
            self.emit(rollouts, state, release)


class _Countdown:
    """A release called once per chunk lent: calls done when the last of them has been."""

    def __init__(self, left: int, done: Callable[[], None]):
        self.left, self.done = left, done
        self._lock = threading.Lock()  # the learner gives back while a session may stop the queue

    def __call__(self) -> None:
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.done()


def lends(emit: Emit, num_envs: int, chunk_size: int) -> bool:
    """Whether a builder lends its rows to emit (rather than copies out of them)."""
    return getattr(emit, "takes_buffers", False) and num_envs % chunk_size == 0


def row_layout(specs: dict, num_envs: int, unroll_length: int) -> dict:
    """key -> (shape [T+1, num_envs, ...], numpy dtype) of a client's rows (all but the mask)."""
    return {
        key: ((unroll_length + 1, num_envs, *shape), _numpy_dtype(dtype))
        for key, (shape, dtype) in specs.items()
        if key != "mask"
    }


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
        # The releases of lent chunks handed out as views (a batch that is one chunk): called at the
        # next get_batch, when the (one) learner thread is done with them.
        self._lent = []

    def qsize(self) -> int:
        return self._size

    def put(self, rollouts: dict, state: tuple, stopping: threading.Event, release=None, scarce=True) -> None:
        """Queues a chunk; waits while the queue is full, unless stopping is set. release: the chunk's
        tensors are lent (a server shard's slot, shards.py, or a session's rows, RolloutBuilder), to
        be given back through release once the learner is done with them. scarce: the lender has a
        fixed few (a shard's slots), so what a batch takes of them is copied out at once and they go
        back as soon as wholly taken, unless the chunk is a whole batch; else (a session's rows)
        they are read in place, joined into the batch like any chunk."""
        with self._changed:
            while self._size >= self.capacity and not stopping.is_set():
                self._changed.wait(timeout=0.5)
            if stopping.is_set():
                if release is not None:
                    release()
                return
            self._chunks.append([rollouts, state, 0, release, scarce])
            self._size += width(rollouts)
            self._changed.notify_all()

    def get_batch(self, batch_size: int, done: Callable[[], bool]):
        """B rollouts as (batch [T+1, B, ...], core state [layers, B, ...]); None once done()."""
        pieces = []
        taken = []  # the releases of lent chunks this batch took the last of
        needed = batch_size
        copying = 0.0  # seconds copying out of shards' slots
        lent, self._lent = self._lent, []
        for release in lent:  # the learner is done with the batch it was lent last time
            release()
        with self._changed:
            while needed:
                while not self._chunks:
                    if done():
                        return None
                    self._changed.wait(timeout=0.2)
                chunk = self._chunks[0]
                rollouts, state, first, release, scarce = chunk
                take = min(needed, width(rollouts) - first)
                chunk[2] += take
                whole_batch = take == width(rollouts) == needed and not self.pin
                if chunk[2] == width(rollouts):
                    self._chunks.popleft()
                if release is not None and scarce and not whole_batch:
                    # a shard's slot: copied out at once, and given back once wholly taken
                    copy_started = time.perf_counter()
                    pieces.append((*_taken(rollouts, state, first, first + take, self.pin), 0, take))
                    copying += time.perf_counter() - copy_started
                    if chunk[2] == width(rollouts):
                        release()
                else:
                    pieces.append((rollouts, state, first, first + take))
                    if release is not None and chunk[2] == width(rollouts):
                        taken.append(release)
                self._size -= take
                needed -= take
            self._changed.notify_all()
        started = time.perf_counter()
        columns = [{key: value[:, a:b] for key, value in rollouts.items()} for rollouts, _, a, b in pieces]
        batch = _join(columns, 1, self.pin)
        if batch is columns[0]:  # views of one chunk: given back once the learner is done with them
            self._lent = taken
        else:  # joined into a batch of its own
            for release in taken:
                release()
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
