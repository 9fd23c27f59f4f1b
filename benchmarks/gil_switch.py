"""What Python's GIL switch interval (backend.gil_switch_interval_ms) does to a thread that waits,
beside a busy one, in one process: poly's central inference beside the serving loop (plain Python)
or the learner's thread (torch ops, which give the GIL up as they run). A sketch on the CPU, not
the GPU pass it stands for.

    python benchmarks/gil_switch.py              # 5, 1, 0.5 and 0.2 ms, 3 s each
    python benchmarks/gil_switch.py --intervals-ms 5 0.5 --seconds 5
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time

import torch


def plain_python(stop: threading.Event) -> None:
    total = 0
    while not stop.is_set():
        for _ in range(1000):
            total += 1


def torch_updates(stop: threading.Event) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    optimiser = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 32)
    while not stop.is_set():
        loss = model(x).square().mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()


def beside(busy, seconds: float, wait) -> float:
    """Mean ms of wait() while busy runs on another thread."""
    stop = threading.Event()
    thread = threading.Thread(target=busy, args=(stop,))
    thread.start()
    time.sleep(0.05)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        wait()
        count += 1
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    return 1e3 * elapsed / count


def answered_request(seconds: float) -> float:
    """A request through a queue to an inference thread (a small policy) and its reply, in ms."""
    requests, replies, stop = queue.Queue(), queue.Queue(), threading.Event()
    policy = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 6))

    def serve():
        while not stop.is_set():
            try:
                x = requests.get(timeout=0.1)
            except queue.Empty:
                continue
            with torch.no_grad():
                replies.put(policy(x))

    server = threading.Thread(target=serve)
    server.start()
    x = torch.randn(64, 32)

    def ask():
        requests.put(x)
        replies.get()

    try:
        return beside(torch_updates, seconds, ask)
    finally:
        stop.set()
        server.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals-ms", type=float, nargs="+", default=[5, 1, 0.5, 0.2])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    python_default = sys.getswitchinterval()
    print(f"{'interval':>9}  {'GIL round trip beside plain Python':>35}  {'request answered beside torch updates':>38}")
    try:
        for ms in args.intervals_ms:
            sys.setswitchinterval(ms / 1000)
            round_trip = beside(plain_python, args.seconds, lambda: time.sleep(0))  # gives the GIL up and takes it back
            request = answered_request(args.seconds)
            print(f"{ms:>6g} ms  {round_trip:>32.2f} ms  {request:>35.2f} ms")
    finally:
        sys.setswitchinterval(python_default)


if __name__ == "__main__":
    main()
