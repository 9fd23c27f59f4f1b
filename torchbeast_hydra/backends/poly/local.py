"""Env clients on the learner's machine over shared memory (backend.local_transport=shared_memory).

role=all's clients need none of gRPC's framing: a client writes its envs' outputs into shared
tensors and wakes the ActorPool's thread for it with a semaphore; that thread answers with
actions in another shared tensor and wakes the client with a second semaphore. The tensors the
client writes are its session's unroll rows themselves (rollouts.RolloutBuilder's buffers), at the
row the server names with each answer: the server reads a step in place and copies no frame.

What the server does with a step is the gRPC stream's: the same checks (wire.check_step), the
same Session (central inference in the shared dynamic batch, unroll assembly, partial rollouts
when a client leaves), the same seeds (ActorPool.new_client), the same refusals. Each client
process gets a channel of its own, so a replacement never reads what a dead predecessor left
half-written.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import numpy as np
import torch

from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.backends.poly.batcher import BatcherClosed
from torchbeast_hydra.backends.poly.client import FINISHED, REFUSED, SERVER_FAILED, UNREACHABLE
from torchbeast_hydra.backends.poly.rollouts import lends, row_layout
from torchbeast_hydra.backends.poly.server import ActorPool, InferenceFailed, Refused
from torchbeast_hydra.backends.poly.settings import LOCAL_ROW_SETS
from torchbeast_hydra.env.layout import AGENT_KEYS, rollout_specs
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.run.supervision import parent_alive

log = logging.getLogger(__name__)

RUNNING = -1  # the verdict a client reads with its actions; anything else is the exit code to leave with
POLL_S = 0.25  # how often a side waiting on the other looks whether it is still there


class Channel:
    """One client process's step, in shared memory: the rows its envs' outputs go into (its
    session's unroll rows, rollouts.row_layout's [T+1, num_envs, ...], `buffers` sets of them), where
    the next step goes (which set, which row), the actions answering a step, and the server's
    verdict (RUNNING, or the exit code the client is to leave with)."""

    def __init__(self, spec: EnvSpec, num_envs: int, ctx, unroll_length: int, buffers: int = 1):
        self.num_envs = num_envs
        layout = row_layout(rollout_specs(spec), num_envs, unroll_length)
        self.rows = [
            {key: torch.from_numpy(np.zeros(shape, dtype)).share_memory_() for key, (shape, dtype) in layout.items()}
            for _ in range(buffers)
        ]
        self.env_keys = tuple(key for key in layout if key not in AGENT_KEYS)
        self.where = torch.zeros(2, dtype=torch.int64).share_memory_()  # (buffer, row) of the next step
        dtype = torch.from_numpy(np.zeros(0, spec.actions.dtype)).dtype
        self.actions = torch.zeros((num_envs, *spec.actions.step_shape), dtype=dtype).share_memory_()
        self.verdict = torch.full((1,), RUNNING, dtype=torch.int64).share_memory_()
        self.stepped = ctx.Semaphore(0)  # the client wrote its envs' outputs
        self.answered = ctx.Semaphore(0)  # the server wrote their actions, or a verdict

    def arrays(self) -> list:
        """The rows as numpy arrays (each process makes its own views)."""
        return [{key: tensor.numpy() for key, tensor in rows.items()} for rows in self.rows]

    def step_views(self, arrays: list) -> dict:
        """The env keys' arrays [num_envs, ...] where the next step goes: views into arrays()."""
        buffer, row = self.where.tolist()
        return {key: arrays[buffer][key][row] for key in self.env_keys}


# -- the client's side: a process of its own ---------------------------------------------------


def client_main(channel: Channel, num_envs: int, seed: int, make_envs) -> None:
    """A local client process: steps its envs with the actions the server writes, until the
    server's verdict ends it (exit code FINISHED or REFUSED) or the learner process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # SLURM signals the whole job; the parent handles it
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][client][%(levelname)s] - %(message)s")
    envs = make_envs(num_envs, seed)
    rows = channel.arrays()
    actions = channel.actions.numpy()
    try:
        outputs = envs.initial()
        while True:
            for key, view in channel.step_views(rows).items():
                view[...] = outputs[key]
            channel.stepped.release()
            while not channel.answered.acquire(timeout=POLL_S):
                if not parent_alive():
                    sys.exit(UNREACHABLE)  # the learner is gone, without a word
            verdict = int(channel.verdict[0])
            if verdict != RUNNING:
                sys.exit(verdict)
            outputs = envs.step(actions.copy())  # the next answer overwrites them
    finally:
        envs.close()


# -- the server's side: a thread in the learner process per client -----------------------------


def start_client(pool: ActorPool, ctx, num_envs: int, make_envs, index: int):
    """Starts client process `index` with a channel of its own, and the pool's thread serving it;
    returns the process (ActorProcesses supervises and replaces it)."""
    settings = pool.settings
    buffers = LOCAL_ROW_SETS if lends(pool.emit, num_envs, settings.chunk_size) else 1
    channel = Channel(pool.spec, num_envs, ctx, settings.unroll_length, buffers)
    client_id, seed = pool.new_client()
    process = ctx.Process(
        target=client_main,
        kwargs=dict(channel=channel, num_envs=num_envs, seed=seed, make_envs=make_envs),
        name=f"env-client-{index}",
        daemon=True,
    )
    process.start()
    threading.Thread(
        target=serve, args=(pool, channel, process, client_id), name=f"actorpool-local-{client_id}", daemon=True
    ).start()
    return process


def serve(pool: ActorPool, channel: Channel, process, client_id: int) -> None:
    """Answers the client's steps until the pool stops, the client dies or is refused. A client
    silent for longer than client_idle_timeout_s (a hung env) is killed, to be replaced."""
    session, verdict = None, FINISHED
    idle_timeout_s = pool.settings.client_idle_timeout_s
    rows = channel.arrays()
    where = channel.where.numpy()
    actions = channel.actions.numpy()
    waiting_since = time.monotonic()
    try:
        while not pool.stopping.is_set():
            if not channel.stepped.acquire(timeout=POLL_S):
                if not process.is_alive():
                    return  # its supervisor reports and replaces it
                if time.monotonic() - waiting_since > idle_timeout_s:
                    log.warning(
                        "Dropped local client %d (pid %s): no step for %g s (backend.client_idle_timeout_s).",
                        client_id,
                        process.pid,
                        idle_timeout_s,
                    )
                    process.kill()
                    return
                continue
            if session is None:
                session = pool.open_session(channel.num_envs, rows)
                log.info("Client %d connected over shared memory with %d envs.", client_id, channel.num_envs)
            started = time.thread_time()  # as the gRPC stream counts: our CPU time, not inference's wait
            try:
                step = _received(pool, channel.step_views(rows))
                actions[...] = session.step(step, written=session.builder.env_keys)
            except (BatcherClosed, InferenceFailed):
                break
            where[:] = session.builder.next_row()
            pool.count_step(time.thread_time() - started, channel.num_envs)
            waiting_since = time.monotonic()
            channel.answered.release()
    except (wire.WireError, Refused) as refused:
        pool.refuse(session, f"{client_id} (local, pid {process.pid})", str(refused))
        verdict = REFUSED
    except Exception:  # ours, not the client's: say so, and stop the run rather than leave it unanswered
        log.exception("Serving local client %d (pid %s) failed.", client_id, process.pid)
        verdict = SERVER_FAILED
    finally:
        channel.verdict[0] = verdict
        channel.answered.release()
        if session is not None:
            pool.close_session(session, client_id)


def _received(pool: ActorPool, outputs: dict) -> dict:
    """The client's step (outputs: views of its rows), checked as the wire checks. Not copied: the
    client waits for its answer before it writes again, and then into the next row."""
    return wire.check_step(dict(outputs), pool.spec, pool.settings.float_limit)
