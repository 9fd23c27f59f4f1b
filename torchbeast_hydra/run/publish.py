"""Publishing the learner's weights to the acting policy (mono's shared CPU copy, poly's
inference copy) every backend.publish_interval updates, without making a GPU learner wait.

- CPU learner: a plain copy under the locks; there is nothing to overlap it with.
- GPU learner, CPU policy (mono): the copy to pinned staging memory is queued on the learner's
  stream, which goes on at once; a thread waits for it and writes the staging into the policy.
  A publish that finds the previous one still in flight is skipped: the next carries newer weights.
- GPU learner, GPU policy (poly): a device-to-device copy queued on the learner's stream, ordered
  against inference (on its own stream) by CUDA events rather than by waiting on the host.
- backend.synchronous: a synchronous copy after every update (nothing skipped, nothing in flight),
  then whoever waits for newer weights is told (mono's buffer pool, poly's sessions).

`version` (a shared-memory tensor, so mono's actor processes read it too) is the learner updates
the acting weights reflect; it is written after the weights, so a reader that sees a version acts
with those weights or newer ones (a lag is never under-counted).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch


class WeightPublisher:
    def __init__(
        self,
        learner_model: torch.nn.Module,
        policy: torch.nn.Module,
        run_lock,
        weights_lock,
        interval: int,
        updates: Callable[[], int] = lambda: 0,
        synchronous: bool = False,
    ):
        """run_lock: held while the learner updates (so a snapshot falls between updates);
        weights_lock: held while the policy's weights are written or read by inference;
        updates(): the learner's update count (read under run_lock: the weights' version)."""
        self.learner_updates = updates
        self.synchronous = synchronous
        self.version = torch.zeros((), dtype=torch.int64).share_memory_()
        self._newer = threading.Condition()  # notified after each publish (wait_for_newer)
        self.on_publish: list[Callable[[], None]] = []  # called after each publish
        self.sources = list(learner_model.state_dict().values())
        self.targets = list(policy.state_dict().values())
        self.run_lock = run_lock
        self.weights_lock = weights_lock
        self.interval = interval
        self.updates = 0
        learner_on_gpu = self.sources[0].is_cuda if self.sources else False
        policy_on_gpu = self.targets[0].is_cuda if self.targets else False
        self.mode = "gpu-to-gpu" if policy_on_gpu else "gpu-to-cpu" if learner_on_gpu else "cpu"
        # gpu-to-gpu: recorded after the latest copy; inference's stream waits on it (wait_for_weights).
        self.published = None
        self.inference_done = None  # recorded by inference after its forward pass; the copy waits on it
        self._staging = None
        self._in_flight = threading.Event()
        self._ready = threading.Condition()
        self._copied = None
        self._closed = False
        self._thread = None
        self.skipped = 0  # publishes dropped because the previous one was still in flight
        if self.mode == "gpu-to-cpu":
            self._staging = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self.sources]
            self._thread = threading.Thread(target=self._write_staging, name="weights-publisher", daemon=True)
            self._thread.start()

    def publish_now(self) -> None:
        """A synchronous copy (at start, before anything acts; after every update when synchronous)."""
        with torch.no_grad(), self.run_lock, self.weights_lock:
            for target, source in zip(self.targets, self.sources):
                target.copy_(source)
            if self.mode != "cpu":  # inference's own stream must not read the policy before this copy is done
                torch.cuda.current_stream(self.sources[0].device).synchronize()
            self._published(self.learner_updates())

    def _published(self, version: int) -> None:
        """The acting weights now reflect `version` updates: say so to readers and waiters."""
        self.version.fill_(version)
        with self._newer:
            self._newer.notify_all()
        for listener in self.on_publish:
            listener()

    def wait_for_newer(self, version: int, stop: threading.Event) -> None:
        """Waits until the acting weights are newer than `version`, or stop is set."""
        with self._newer:
            while int(self.version) <= version and not stop.is_set():
                self._newer.wait(timeout=0.2)

    def after_update(self) -> None:
        """Called by a learner thread after each update: publishes every `interval` updates."""
        with self.run_lock:
            self.updates += 1
            due = self.updates % self.interval == 0
        if not due:
            return
        if self.mode == "cpu" or self.synchronous:
            self.publish_now()
        elif self.mode == "gpu-to-cpu":
            self._stage()
        else:
            self._copy_on_device()

    # -- GPU learner, CPU policy ---------------------------------------------------------------

    def _stage(self) -> None:
        with torch.no_grad(), self.run_lock:  # queued between two updates: one consistent snapshot
            if self._in_flight.is_set():  # the thread still writes the last one from the staging
                self.skipped += 1
                return
            self._in_flight.set()
            for staging, source in zip(self._staging, self.sources):
                staging.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            version = self.learner_updates()
        with self._ready:
            self._copied = (copied, version)
            self._ready.notify()

    def _write_staging(self) -> None:
        while True:
            with self._ready:
                while self._copied is None and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                (copied, version), self._copied = self._copied, None
            copied.synchronize()  # this thread waits for the copy, not the learner
            with torch.no_grad(), self.weights_lock:
                for target, staging in zip(self.targets, self._staging):
                    target.copy_(staging)
                self._published(version)
            self._in_flight.clear()

    # -- GPU learner, GPU policy ---------------------------------------------------------------

    def _copy_on_device(self) -> None:
        with torch.no_grad(), self.run_lock, self.weights_lock:
            stream = torch.cuda.current_stream(self.sources[0].device)
            if self.inference_done is not None:  # never overwrite weights a queued forward pass reads
                stream.wait_event(self.inference_done)
            for target, source in zip(self.targets, self.sources):
                target.copy_(source, non_blocking=True)
            self.published = torch.cuda.Event()
            self.published.record(stream)
            self._published(self.learner_updates())  # inference's stream waits for the copy before it reads

    def wait_for_weights(self, stream) -> None:
        """Inference (holding weights_lock): its stream waits for the latest copy, on the device."""
        if self.published is not None:
            stream.wait_event(self.published)

    def close(self) -> None:
        if self._thread is not None:
            with self._ready:
                self._closed = True
                self._ready.notify()
            self._thread.join(timeout=5.0)
