"""MonoBeast: actor processes + shared-memory rollout buffers + learner threads, on one machine.

Each actor process steps `envs_per_actor` envs in lockstep and evaluates a CPU copy of the policy
(shared memory, updated in place by the learner) on all of them as one batch. It writes each env's
unroll straight into a shared buffer [T+1, ...] and tells the learner which buffers are full.

Buffers are handed out by a `BufferPool` in the learner process over one pipe per actor, rather
than through queues shared by all actors: an actor killed mid-operation then cannot leave a
cross-process lock held, and the buffers it held are known exactly and reclaimed when it is
replaced.

An actor checks its envs' float observations before the policy sees them (ObservationGuard): one
the model cannot compute with stops the run naming the env, the leaf and the value, rather than
surfacing later as a NaN loss.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from multiprocessing import connection

import numpy as np
import torch
from omegaconf import OmegaConf

from torchbeast_hydra.agent.distributions import NonFiniteAction
from torchbeast_hydra.agent.models import make_model
from torchbeast_hydra.backends.loop import Backend
from torchbeast_hydra.backends.mono.settings import num_buffers
from torchbeast_hydra.env.actions import ActionError, bad_rows
from torchbeast_hydra.env.engines import envs_maker
from torchbeast_hydra.env.layout import AGENT_KEYS, env_keys, fits_limit, within_limit, zero_rollouts
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.learning import accel
from torchbeast_hydra.logs.metrics import measured
from torchbeast_hydra.run.seeding import actor_seed
from torchbeast_hydra.run.supervision import ActorProcesses, process_context
from torchbeast_hydra.run.training_run import TrainingRun

NONFINITE_ACTION = 5  # an actor's exit code: its policy produced a NaN/inf action (stops the run)
# What an actor sends the learner: a report of full buffers, or a fault (text) that stops the run.
REPORT, FAULT = b"R", b"F"


class BadObservation(ValueError):
    """An env returned an observation the model cannot compute with; the text names the env, leaf and value."""


class ObservationGuard:
    """Checks the float observation leaves an actor's envs return against the largest magnitude the
    model computes with (accel.float_limit): a float64 1e300, or inf, would be inf in the model, then
    NaN in the loss. Such values raise BadObservation; with clip (backend.clip_obs_to_model_range),
    they are clipped to the limit instead and counted (NaN has no nearest value: it still raises)."""

    def __init__(self, spec: EnvSpec, env_id: str, limit: float, clip: bool):
        self.keys = [leaf.key for leaf in spec.leaves if leaf.dtype.kind == "f"]
        self.env_id, self.limit, self.clip = env_id, limit, clip
        self.clipped = 0  # observations (envs' steps) clipped since the last take_clipped()

    def __call__(self, outputs: dict) -> None:
        """outputs: the envs' arrays [num_envs, ...] (Environments'), clipped in place if asked."""
        for key in self.keys:
            array = outputs[key]
            if fits_limit(array, self.limit):
                continue
            inside = within_limit(array, self.limit)
            if self.clip:
                numbers = ~np.isnan(array)
                if numbers.all():
                    self.clipped += len(bad_rows(inside))
                    np.clip(array, -self.limit, self.limit, out=array)
                    continue
                inside = numbers  # NaN has no nearest value to clip to
            raise BadObservation(self._describe(key, array, inside))

    def take_clipped(self) -> int:
        clipped, self.clipped = self.clipped, 0
        return clipped

    def _describe(self, key: str, array: np.ndarray, inside: np.ndarray) -> str:
        env = bad_rows(inside)[0]
        value = float(array[env][~inside[env]][0])
        what = f"env {env} ({self.env_id}) returned an observation the model cannot take: {key} holds {value:g}"
        if np.isnan(value):
            return f"{what}. Fix the env (or wrap it) so that it returns numbers."
        return (
            f"{what}, beyond +-{self.limit:.4g}, the largest the model computes with. Fix the env (or wrap it), "
            "or set backend.clip_obs_to_model_range=true to clip such values to it."
        )


def create_buffers(spec: EnvSpec, unroll_length: int, count: int) -> dict:
    """Shared-memory tensors [T+1, count, ...]: indexing dim 1 gathers a time-major batch. Mono's
    unrolls are always whole: the mask stays set."""
    return {key: buffer.share_memory_() for key, buffer in zero_rollouts(spec, unroll_length, count).items()}


def create_state_buffers(model, count: int) -> tuple:
    """The core state at the start of each buffer's unroll (empty without an LSTM)."""
    return tuple(torch.zeros_like(s).repeat(1, count, 1).share_memory_() for s in model.initial_state(1))


def _encode(indices) -> bytes:
    return np.asarray(indices, np.int32).tobytes()


def _decode(message: bytes) -> list:
    return np.frombuffer(message, np.int32).tolist()


def _encode_report(indices, env_s: float, inference_s: float, clipped: int) -> bytes:
    """An actor's report: the CPU seconds it spent stepping envs and in the policy while filling
    these buffers (per-step costs for logs.csv and benchmarks/throughput.py), the observations it
    clipped, then the buffers."""
    return REPORT + np.asarray([env_s, inference_s, clipped], np.float64).tobytes() + _encode(indices)


def _decode_report(message: bytes) -> tuple:
    env_s, inference_s, clipped = np.frombuffer(message[1:25], np.float64)
    return _decode(message[25:]), float(env_s), float(inference_s), int(clipped)


class BufferPool:
    """Hands out free buffers to actors (k at a time) and collects full ones for the learner.

    version: with backend.synchronous, the acting weights' version (WeightPublisher.version): an
    actor is granted its next buffers only once the weights are newer than at its last grant, so
    each unroll is acted by weights no unroll of that actor has used (regrant() on each publish)."""

    def __init__(self, count: int, per_actor: int, unroll_length: int, version: torch.Tensor | None = None):
        self.per_actor, self.unroll_length = per_actor, unroll_length
        self.version = version
        self.granted_at = {}  # actor index -> the weights' version at its last grant (synchronous)
        self.free = list(range(count))
        self.full = queue.Queue()
        self.granted = {}  # actor index -> buffer indices it is filling
        self.waiting = []  # actors waiting for a grant
        self.conns = {}  # actor index -> learner end of its pipe
        self._lock = threading.Lock()
        self._acting = np.zeros(4)  # env seconds, inference seconds, env steps, clipped: since take_acting_stats
        self.faults = []  # (actor index, text): what stopped an actor, for the run to stop on

    def add_actor(self, index: int, conn) -> None:
        with self._lock:
            self.conns[index] = conn
            self.waiting.append(index)
            self._grant()

    def remove_actor(self, index: int) -> None:
        """Forget a dead actor and reclaim the buffers it was filling."""
        with self._lock:
            self.free.extend(self.granted.pop(index, []))
            self.granted_at.pop(index, None)  # its replacement starts at once: it has acted nothing yet
            if index in self.waiting:
                self.waiting.remove(index)
            conn = self.conns.pop(index, None)
            if conn is not None:
                conn.close()
            self._grant()

    def regrant(self) -> None:
        """New weights are published: actors waiting for them may go on."""
        with self._lock:
            self._grant()

    def release(self, indices) -> None:
        """The learner has copied these buffers: they can be filled again."""
        with self._lock:
            self.free.extend(indices)
            self._grant()

    def receive(self, timeout: float) -> list:
        """Waits for actors' messages; queues full buffers. Returns actors whose pipe broke."""
        broken = []
        for conn in connection.wait(list(self.conns.values()), timeout):
            index = next(i for i, c in self.conns.items() if c is conn)
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                broken.append(index)
                continue
            if message.startswith(FAULT):
                self.faults.append((index, message[1:].decode()))
                continue
            indices, env_s, inference_s, clipped = _decode_report(message)
            with self._lock:
                self._acting += (env_s, inference_s, len(indices) * self.unroll_length, clipped)
                self.granted.pop(index, None)
                self.waiting.append(index)
                self._grant()
            for i in indices:
                self.full.put(i)
        return broken

    def take_acting_stats(self) -> tuple:
        """Actors' core-microseconds per env step in env.step and in the policy, and the observations
        they clipped, since the last call."""
        with self._lock:
            (env_s, inference_s, steps, clipped), self._acting = self._acting, np.zeros(4)
        if not steps:
            return None, None, int(clipped)
        return 1e6 * env_s / steps, 1e6 * inference_s / steps, int(clipped)

    def _grant(self) -> None:
        waiting = []
        while self.waiting and len(self.free) >= self.per_actor:
            index = self.waiting.pop(0)
            if self.version is not None:
                version = int(self.version)
                if self.granted_at.get(index, -1) >= version:  # these weights acted its last unroll
                    waiting.append(index)
                    continue
                self.granted_at[index] = version
            grant, self.free = self.free[: self.per_actor], self.free[self.per_actor :]
            try:
                self.conns[index].send_bytes(_encode(grant))
            except (BrokenPipeError, OSError):
                self.free.extend(grant)  # the supervisor will notice the dead actor
                continue
            self.granted[index] = grant
        self.waiting = waiting + self.waiting

    def stop_actors(self) -> None:
        with self._lock:
            for conn in self.conns.values():
                try:
                    conn.send_bytes(b"")  # an empty grant means: exit
                except (BrokenPipeError, OSError):
                    pass


def actor_main(
    env_id,
    make_envs,
    num_envs,
    seed,
    unroll_length,
    model,
    version,
    buffers,
    state_buffers,
    conn,
    obs_limit,
    clip_obs,
    bf16,
):
    """An actor process: fill the granted buffers with unrolls until told to stop. make_envs:
    env/native.py's maker (the native vector env for Atari ids, else the gymnasium envs); version:
    the shared model's (WeightPublisher.version); bf16: its forward passes under bf16 autocast
    (accel.acts_in_bf16)."""
    torch.set_num_threads(1)  # one core-sized slice each; the learner gets the rest
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the learner, which stops us
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # SLURM signals the whole job; the parent handles it
    torch.manual_seed(seed)
    envs = make_envs(num_envs, seed)
    guard = ObservationGuard(envs.spec, env_id, obs_limit, clip_obs)
    try:
        _act(envs, guard, unroll_length, model, version, buffers, state_buffers, conn, bf16)
    except (EOFError, ConnectionError, KeyboardInterrupt):
        pass  # the learner is gone (stopped us, or died: a reset pipe) or stopping
    except BadObservation as error:  # the learner stops the run with this text; we wait to be stopped
        try:
            conn.send_bytes(FAULT + str(error).encode())
            while conn.recv_bytes():  # alive till then: a dead actor would be replaced, its text lost
                pass
        except (EOFError, OSError):
            pass
    except (NonFiniteAction, ActionError) as error:  # never step an env with NaN: the run stops
        print(f"Actor stopped: {error}", file=sys.stderr, flush=True)
        sys.exit(NONFINITE_ACTION)
    finally:
        envs.close()


def _observe(outputs: dict, guard: ObservationGuard) -> dict:
    """The envs' outputs, checked (and clipped) by guard, as tensor views [1, num_envs, ...]. Taken
    from each step's outputs: an env maker may hand back new arrays each step (the native vector
    env's frames are its own buffers), not only write into the same ones."""
    guard(outputs)
    return {key: torch.from_numpy(array).unsqueeze(0) for key, array in outputs.items()}


def _act(envs, guard, unroll_length, model, version, buffers, state_buffers, conn, bf16: bool = False) -> None:
    cpu = torch.device("cpu")

    def policy(env_output: dict, core_state: tuple):
        # Read before the pass: the publisher writes the version after the weights, so the pass
        # uses these weights or newer ones (a lag is never under-counted).
        acting = version.clone()
        # A context per pass: autocast keeps its bf16 copies of the weights until its context
        # ends, and the learner rewrites them between passes.
        with torch.no_grad(), accel.autocast(bf16, cpu):
            outputs, core_state = model(env_output, core_state)
        outputs["policy_version"] = acting.expand(outputs["baseline"].shape)
        return outputs, core_state

    env_output = _observe(envs.initial(), guard)
    core_state = model.initial_state(len(envs))
    agent_output, _ = policy(env_output, core_state)
    agent_output = {key: torch.zeros_like(value) for key, value in agent_output.items()}
    keys = env_keys(envs.spec)  # ENV_KEYS, with the observation's leaves in frame's place

    def write_row(t: int, idx: torch.Tensor) -> None:
        for key in keys:
            buffers[key][t, idx] = env_output[key][0]
        for key in AGENT_KEYS:
            buffers[key][t, idx] = agent_output[key][0]

    while True:
        message = conn.recv_bytes()
        if not message:
            return
        idx = torch.tensor(_decode(message))
        write_row(0, idx)
        for buffer, state in zip(state_buffers, core_state):
            buffer[:, idx] = state
        env_s = inference_s = 0.0
        for t in range(1, unroll_length + 1):
            # CPU time, not wall: core-seconds even when other processes share the cores.
            started = time.process_time()
            agent_output, core_state = policy(env_output, core_state)
            stepped = time.process_time()
            env_output = _observe(envs.step(agent_output["action"][0].numpy()), guard)
            env_s, inference_s = env_s + time.process_time() - stepped, inference_s + stepped - started
            write_row(t, idx)
        conn.send_bytes(_encode_report(idx.tolist(), env_s, inference_s, guard.take_clipped()))


def gather(buffers: torch.Tensor, idx: torch.Tensor, pin: bool) -> torch.Tensor:
    """buffers[:, idx] in one copy; into pinned memory when bound for a GPU, so that the copy to
    the device needs no second staging copy and runs asynchronously (see devices.to_device)."""
    out = torch.empty((buffers.shape[0], len(idx), *buffers.shape[2:]), dtype=buffers.dtype, pin_memory=pin)
    return torch.index_select(buffers, 1, idx, out=out)


class MonoBeast(Backend):
    """Rollouts from actor processes through shared-memory buffers, batched by learner threads."""

    def __init__(self, cfg, run: TrainingRun):
        super().__init__(cfg, run, make_model(cfg.model, run.spec, initialise=False).share_memory())
        backend = cfg.backend
        self.num_learner_threads = backend.num_learner_threads
        self.ctx = process_context()
        count = num_buffers(cfg)
        self.buffers = create_buffers(run.spec, cfg.unroll_length, count)
        self.state_buffers = create_state_buffers(self.policy, count)
        synchronous = backend.synchronous
        self.pool = BufferPool(
            count, backend.envs_per_actor, cfg.unroll_length, self.publisher.version if synchronous else None
        )
        if synchronous:  # one batch per version: a second learner thread would only learn from stale ones
            self.num_learner_threads = 1
            self.publisher.on_publish.append(self.pool.regrant)
        self.env_cfg = OmegaConf.to_object(cfg.env)
        # One native thread per actor: an actor per core is the machine's share already.
        self.make_envs = envs_maker(self.env_cfg, 1, vector_env=backend.vector_env)
        self.actors = ActorProcesses(
            self._start_actor,
            backend.num_actors,
            backend.max_actor_restarts,
            what="Actor",
            on_exit=self.pool.remove_actor,
            fatal={
                NONFINITE_ACTION: "actor {index}'s policy produced a non-finite action (see the log above); "
                "look for NaN/inf observations or rewards, or lower optim.learning_rate."
            },
        )
        self._batch_lock = threading.Lock()

    def _start_actor(self, index: int, number: int):
        backend = self.cfg.backend
        learner_end, actor_end = self.ctx.Pipe()
        seed = actor_seed(self.cfg.seed, number, backend.envs_per_actor)
        process = self.ctx.Process(
            target=actor_main,
            name=f"actor-{index}",
            args=(
                self.env_cfg.id,
                self.make_envs,
                backend.envs_per_actor,
                seed,
                self.cfg.unroll_length,
                self.policy,
                self.publisher.version,
                self.buffers,
                self.state_buffers,
                actor_end,
                self.float_limit,
                backend.clip_obs_to_model_range,
                self.bf16_acting,
            ),
            daemon=True,
        )
        process.start()
        actor_end.close()
        self.pool.add_actor(index, learner_end)
        return process

    def start(self) -> None:
        self.actors.start()

    def wait(self, timeout: float) -> None:
        broken = self.pool.receive(timeout)
        if self.pool.faults:
            index, text = self.pool.faults[0]
            raise BadObservation(f"actor {index}'s {text}")
        self.actors.supervise(replace=not self.run.stopping, broken=broken)

    def next_batch(self):
        """B full buffers copied out; None when the run is done."""
        indices = []
        with self._batch_lock:
            while len(indices) < self.cfg.batch_size:
                if self.run.done:
                    self.pool.release(indices)
                    return None
                try:
                    indices.append(self.pool.full.get(timeout=0.2))
                except queue.Empty:
                    continue
        started = time.perf_counter()
        idx = torch.tensor(indices)
        pin = self.run.device.type == "cuda"
        batch = {key: gather(buffer, idx, pin) for key, buffer in self.buffers.items()}
        core_state = tuple(gather(buffer, idx, pin) for buffer in self.state_buffers)
        self.pool.release(indices)
        env_us, inference_us, clipped = self.pool.take_acting_stats()
        observed = dict(
            free_queue_size=len(self.pool.free),
            full_queue_size=self.pool.full.qsize(),
            gather_ms=round(1000 * (time.perf_counter() - started), 3),
            actor_env_us_per_step=measured(env_us),
            actor_inference_us_per_step=measured(inference_us),
        )
        if self.cfg.backend.clip_obs_to_model_range:
            observed["clipped_obs"] = clipped  # observations clipped since the last row
        return batch, core_state, observed

    def describe(self) -> dict:
        backend = self.cfg.backend
        envs = backend.num_actors * backend.envs_per_actor
        return dict(
            backend=f"mono, {self.num_learner_threads} learner threads, {num_buffers(self.cfg)} rollout buffers",
            acting=f"{backend.num_actors} actor processes x {backend.envs_per_actor} envs = {envs} envs, CPU inference",
        )

    def shut_down(self) -> None:
        self.pool.stop_actors()
        self.actors.stop(timeout=5.0)


def train(cfg, run: TrainingRun) -> None:
    MonoBeast(cfg, run).train()
