"""Dynamic batching: requests from many threads, or coroutines, are evaluated together in one call.

A request is a dict of tensors sharing a leading batch dimension (a client's envs). The worker
takes the first waiting request, then gathers more until the batch would exceed max_batch_size,
timeout_s has passed since it took the first, or every producer (producers(), when given) has a
request in it: there is no one left to wait for. A request is never split, so one larger than
max_batch_size runs alone.

Coroutines on an event loop (the gRPC server's, serving.py) submit with infer() and await the
answer: the worker answers all of a batch's callers on one loop with one wake-up of that loop.

An exception from the evaluated function is handed to on_error, then answered to every caller of
that batch: the owner decides whether the batcher's failure ends its work (poly's inference: it
does), and knows before any caller does.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

Tensors = dict  # str -> torch.Tensor with a leading batch dimension


class BatcherClosed(RuntimeError):
    """The batcher stopped before it could answer."""


class DynamicBatcher:
    def __init__(
        self,
        fn: Callable[[Tensors], Tensors],
        max_batch_size: int,
        timeout_s: float,
        producers: Callable[[], int] | None = None,
        setup: Callable[[], None] | None = None,
        name: str = "batcher",
        on_error: Callable[[BaseException], None] | None = None,
        pin: bool = False,
        assemble: Callable[[list], Tensors] | None = None,
    ):
        """producers: how many callers there are (no waiting once all are in a batch);
        setup: run first on the worker thread (e.g. torch.set_num_threads, which is per thread);
        on_error: called with an exception fn raised (on the worker thread);
        pin: batches assembled in pinned memory (bound for a GPU: the copy there is asynchronous);
        assemble: makes one batch of the requests instead (a server shard: into shared memory)."""
        self.fn = fn
        self.producers = producers
        self.setup = setup
        self.on_error = on_error
        self.pin = pin
        self.assemble = assemble
        self.max_batch_size = max_batch_size
        self.timeout_s = timeout_s
        self._requests = queue.Queue()
        self._carry = None  # a request taken that did not fit the last batch
        self._closed = threading.Event()
        self._closing = threading.Lock()  # no request can slip in after close() drains the queue
        self._stats_lock = threading.Lock()
        self._stats = []  # (batch size, seconds in fn, CPU seconds of the whole batch) since the last take_stats()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, inputs: Tensors) -> Future:
        future = Future()
        self._put(inputs, future)
        return future

    def infer(self, inputs: Tensors) -> asyncio.Future:
        """Submits from a coroutine on a running event loop; await the answer."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._put(inputs, _OnLoop(loop, future))
        return future

    def _put(self, inputs: Tensors, waiter) -> None:
        size = _size(inputs)
        with self._closing:
            if self._closed.is_set():
                _answer([waiter], [BatcherClosed("the batcher is closed")])
            else:
                self._requests.put((inputs, size, waiter))

    def __call__(self, inputs: Tensors) -> Tensors:
        """Submits and waits for the answer."""
        return self.submit(inputs).result()

    def take_stats(self) -> list:
        """(size, seconds in fn, CPU seconds) of each batch run since the last call (for logging): the CPU
        is this thread's for the whole batch, gathering, assembling, fn and answering (host work, with a
        model that costs next to nothing on the host)."""
        with self._stats_lock:
            stats, self._stats = self._stats, []
        return stats

    def close(self) -> None:
        with self._closing:
            self._closed.set()
        self._thread.join()
        waiters = [waiter for _, _, waiter in self._drain()]
        _answer(waiters, [BatcherClosed("the batcher is closed")] * len(waiters))

    def _drain(self) -> list:
        pending = [self._carry] if self._carry else []
        self._carry = None
        while True:
            try:
                pending.append(self._requests.get_nowait())
            except queue.Empty:
                return pending

    def _next(self, timeout: float):
        if self._carry is not None:
            request, self._carry = self._carry, None
            return request
        return self._requests.get(timeout=timeout) if timeout > 0 else self._requests.get_nowait()

    def _gather(self) -> list:
        """One batch of requests: the first waiting, then whoever arrives before the deadline."""
        batch = [self._next(timeout=0.1)]
        size = batch[0][1]
        deadline = time.monotonic() + self.timeout_s
        while size < self.max_batch_size:
            if self.producers is not None and len(batch) >= self.producers():
                break
            try:
                request = self._next(timeout=deadline - time.monotonic())
            except queue.Empty:
                break
            if size + request[1] > self.max_batch_size:
                self._carry = request
                break
            batch.append(request)
            size += request[1]
        return batch

    def _loop(self) -> None:
        if self.setup is not None:
            self.setup()
        while not self._closed.is_set():
            cpu_started = time.thread_time()
            try:
                batch = self._gather()
            except queue.Empty:
                continue
            sizes = [size for _, size, _ in batch]
            started = time.perf_counter()
            try:
                outputs = self.fn(self._assemble([request for request, _, _ in batch]))
                parts = {key: value.split(sizes) for key, value in outputs.items()}
            except Exception as error:  # tell the owner, then every caller: none learns of it first
                if self.on_error is not None:
                    self.on_error(error)
                _answer([waiter for _, _, waiter in batch], [error] * len(batch))
                continue
            seconds = time.perf_counter() - started
            answers = [{key: value[i] for key, value in parts.items()} for i in range(len(batch))]
            _answer([waiter for _, _, waiter in batch], answers)
            with self._stats_lock:
                self._stats.append((sum(sizes), seconds, time.thread_time() - cpu_started))

    def _assemble(self, requests: list) -> Tensors:
        """One batch from the requests: concatenated (into pinned memory if pin), in one copy."""
        if self.assemble is not None:
            return self.assemble(requests)
        if len(requests) == 1 and not self.pin:
            return requests[0]
        return {key: _concat([request[key] for request in requests], self.pin) for key in requests[0]}


class _OnLoop:
    """A coroutine's wait for its answer: a future of its event loop (set only on that loop's thread)."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.loop, self.future = loop, future


def _answer(waiters: list, results: list) -> None:
    """Each waiter its result (an exception is raised to it); the waiters on an event loop get
    theirs in one call on that loop: one wake-up of it a batch, not one a caller."""
    on_loops = {}
    for waiter, result in zip(waiters, results):
        if isinstance(waiter, _OnLoop):
            on_loops.setdefault(waiter.loop, []).append((waiter.future, result))
        else:
            _settle(waiter, result)
    for loop, answers in on_loops.items():
        try:
            loop.call_soon_threadsafe(_settle_all, answers)
        except RuntimeError:  # the loop is closed: nobody there waits any more
            pass


def _settle_all(answers: list) -> None:
    for future, result in answers:
        _settle(future, result)


def _settle(future, result) -> None:
    if future.done():  # an awaiting coroutine was cancelled (its stream went away)
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _concat(tensors: list, pin: bool) -> torch.Tensor:
    first = tensors[0]
    size = sum(t.shape[0] for t in tensors)
    out = torch.empty((size, *first.shape[1:]), dtype=first.dtype, pin_memory=pin)
    return torch.cat(tensors, out=out)


def _size(inputs: Tensors) -> int:
    sizes = {value.shape[0] for value in inputs.values()}
    if len(sizes) != 1:
        raise ValueError(f"inputs must share their leading (batch) dimension, got sizes {sorted(sizes)}")
    return sizes.pop()
