"""Data-parallel learning on torch.distributed: N ranks, one learner each, the same weights on all.

Each rank is a whole run of its own (its actors or poly server and env clients, its own batches,
its own device) except for the collectives of each update, made in the same order on every rank:

1. `agree`: every rank's (agent steps, finished episodes' returns, whether a signal asked it to
   stop) reach every rank (one small exchange of JSON bytes), so every rank counts the same global
   step, rank 0 logs every rank's returns, and all ranks stop after the same update;
2. `average_gradients`: after backward, one all_reduce of all gradients (and the loss terms)
   flattened into one buffer, divided by N; each rank then takes the same optimiser step;
3. with `model.normalize_obs`, `sum_over_ranks` in each learner forward pass that updates the
   observation statistics: the batches' moments, so every rank's statistics count every batch.

So the effective batch is N x batch_size unrolls, and the gradient is the mean of the ranks'
(each a sum over its batch, as with one rank): the learning rate stays that of one rank.

Rank 0 alone writes the run dir (log, logs.csv, wandb, TensorBoard, checkpoints, evaluations):
`for_rank` turns the other ranks' sinks off. Where ranks come from (`from_environment`): torchrun's
variables, submitit's SLURM tasks, or `distributed.nproc=N`, for which rank 0 starts the others
itself (`spawn_others`). A run with one rank asks `wanted` and takes no other path here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torchbeast_hydra.backends import registry
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.launch.settings import DistBackend
from torchbeast_hydra.run.resume import config_changes
from torchbeast_hydra.run.seeding import rank_seed, seed_everything
from torchbeast_hydra.run.settings import to_plain_dict

log = logging.getLogger(__name__)

SPAWNED = "TORCHBEAST_HYDRA_SPAWNED"  # set in the ranks that distributed.nproc started
PROGRESS_KEY = "torchbeast_hydra/collectives/{}"  # per rank: the collectives it has entered
PROCESS_KEY = "torchbeast_hydra/process/{}"  # per rank: "HOST PID"
DIAGNOSIS_TIMEOUT_S = 5.0  # to read the others' progress once a collective failed
WIND_DOWN_S = 60.0  # for spawned ranks to stop their actors after the last update
KILL_AFTER_S = 5.0  # from SIGTERM to SIGKILL for a spawned rank that must end
MAX_CAUSE_CHARS = 160  # of the backend's own message, in the one line that names the rank


class RankFailure(RuntimeError):
    """Another rank died, hung, or stopped answering: this rank stops too."""


@dataclass(frozen=True)
class RankEnv:
    """This process's place among the ranks, as the launcher (torchrun, SLURM, the spawn) gives it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def from_environment() -> RankEnv | None:
    """The ranks torchrun, a spawning parent or submitit's SLURM tasks declare; None: one rank.

    torchrun (and distributed.nproc's children) export RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT; a SLURM job of several tasks under submitit gets them from
    submitit's TorchDistributedEnvironment (master: the job's first node; port: from the job id, so
    a requeued job finds it again)."""
    env = os.environ
    if "RANK" not in env and slurm_tasks() > 1:
        from submitit.helpers import TorchDistributedEnvironment

        # The device follows local_rank; a MASTER_ADDR left by the cluster or an earlier step is the job's no more.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return None
    world_size = int(env["WORLD_SIZE"])
    return RankEnv(
        rank=int(env["RANK"]),
        world_size=world_size,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
    )


def is_follower() -> bool:
    """Whether this process is a rank other than 0, as the launcher's environment says (before the
    ranks meet)."""
    env = from_environment()
    return env is not None and env.rank != 0


def slurm_tasks() -> int:
    """Tasks of the SLURM job this process is a task of, under submitit (hydra/launcher=slurm); else 0."""
    return int(os.environ.get("SLURM_NTASKS", "1")) if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" else 0


def ranks_on_this_machine(cfg) -> int:
    """How many ranks share this machine's memory: for the memory check, before any starts."""
    ranks = from_environment()
    if ranks is not None:
        return ranks.local_world_size
    return cfg.distributed.nproc


def wanted(cfg) -> bool:
    """Whether this run has more than one rank (else nothing here runs)."""
    return cfg.distributed.nproc > 1 or from_environment() is not None


def follower_overrides(argv: list[str]) -> list[str]:
    """What a rank other than 0, started by torchrun or the spawning parent, adds to its command line
    (before Hydra composes): rank 0 alone writes the run dir (.hydra/, the log), and its run dir is
    the run's (`shared_run_dir`), so this rank's own Hydra dir is the working dir, left untouched."""
    if int(os.environ.get("RANK", "0")) == 0 or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return []
    extra = ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    if not any(arg.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for arg in argv):
        extra.append("hydra.run.dir=.")
    return extra


# -- starting the ranks ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SpawnedRanks:
    """Ranks 1..N-1 that distributed.nproc=N started: this process is rank 0 (as Lightning does)."""

    def __init__(self, nproc: int, task_overrides: list[str], run_dir: Path):
        shared = dict(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1")
        shared["MASTER_PORT"] = str(free_port())
        os.environ.update(shared, RANK="0", LOCAL_RANK="0")
        command = [sys.executable, "-m", "torchbeast_hydra", *task_overrides, f"hydra.run.dir={run_dir}"]
        self.processes = [
            subprocess.Popen(command, env={**os.environ, **shared, "RANK": str(r), "LOCAL_RANK": str(r), SPAWNED: "1"})
            for r in range(1, nproc)
        ]

    def wait(self, timeout_s: float) -> None:
        """Waits for the others to end, and ends those still running after timeout_s."""
        deadline = time.monotonic() + timeout_s
        for rank, process in enumerate(self.processes, start=1):
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("Rank %d did not stop within %.0f s: ending it.", rank, timeout_s)
                process.terminate()
                try:
                    process.wait(KILL_AFTER_S)
                except subprocess.TimeoutExpired:  # e.g. stopped (SIGSTOP): SIGTERM waits for SIGCONT
                    process.kill()
                    process.wait()


@contextlib.contextmanager
def running(ranks: Ranks, spawned: SpawnedRanks | None):
    """Around a rank's training: at the end, the process group goes; the ranks this one spawned
    get WIND_DOWN_S to stop after the same update, or KILL_AFTER_S when this rank failed (the
    others cannot go on without it)."""
    try:
        yield
    except BaseException:
        if spawned is not None:
            spawned.wait(0)
        raise
    else:
        if spawned is not None:
            spawned.wait(WIND_DOWN_S)
    finally:
        ranks.close()


def spawn_others(cfg, run_dir: Path) -> SpawnedRanks | None:
    """distributed.nproc=N outside torchrun and SLURM: start ranks 1..N-1 with this run's overrides
    in this run dir, and become rank 0. None where the ranks come from elsewhere."""
    if cfg.distributed.nproc <= 1 or os.environ.get(SPAWNED):
        return None
    if "RANK" in os.environ or slurm_tasks() > 1:
        raise ConfigError(
            f"distributed.nproc={cfg.distributed.nproc} starts ranks itself; under torchrun or a SLURM job of "
            "several tasks, the launcher starts them: leave distributed.nproc at 1."
        )
    from hydra.core.hydra_config import HydraConfig

    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("hydra.")]
    return SpawnedRanks(cfg.distributed.nproc, overrides, run_dir)


# -- one rank ---------------------------------------------------------------------------------


@dataclass
class Agreement:
    """What the ranks agree on before each update (Ranks.agree)."""

    steps: int  # agent steps of this update, summed over the ranks
    returns: list  # returns of the episodes that ended in it, on any rank
    stop: bool  # some rank was asked to stop: every rank stops now, without this update
    stop_signal: int | None  # the signal that asked (rank 0 hands it to submitit: requeue)


class Ranks:
    """This rank of a data-parallel run: its process group and the collectives a run makes."""

    def __init__(self, env: RankEnv, backend: str, timeout_s: float):
        self.rank, self.world_size = env.rank, env.world_size
        self.local_rank, self.local_world_size = env.local_rank, env.local_world_size
        self.backend, self.timeout_s = backend, timeout_s
        self.collectives = 0  # entered so far: compared across ranks when one fails
        if backend == "nccl":  # one GPU per rank, by its place on its machine; before NCCL starts
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        # What the ranks agree on is small host data: gloo, whatever carries the gradients.
        timeout = timedelta(seconds=timeout_s)
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        self.store = dist.distributed_c10d._get_default_store()
        # Where this rank runs: a rank killed inside a collective has reached it as far as the
        # progress keys tell, so the others look for its process when one fails.
        self.store.set(PROCESS_KEY.format(self.rank), f"{socket.gethostname()} {os.getpid()}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"{self.world_size} ({self.backend}); effective batch {self.world_size} x the batch below"

    # -- collectives --------------------------------------------------------------------------

    def _collective(self, what: str, fn):
        """Runs one collective; a failure (a rank died) or timeout (a rank hangs) becomes RankFailure
        naming the ranks that never reached it."""
        self.collectives += 1
        self.store.set(PROGRESS_KEY.format(self.rank), str(self.collectives))
        try:
            return fn()
        except RankFailure:
            raise
        except Exception as error:  # gloo/NCCL raise RuntimeError subclasses (DistBackendError, ...)
            raise RankFailure(self._diagnose(what, error)) from error

    def _diagnose(self, what: str, error: Exception) -> str:
        behind, found = [], {}
        try:
            self.store.set_timeout(timedelta(seconds=DIAGNOSIS_TIMEOUT_S))
            for rank in range(self.world_size):
                key = PROGRESS_KEY.format(rank)
                reached = int(self.store.get(key)) if self.store.check([key]) else 0
                if reached < self.collectives:
                    behind.append(rank)
                elif rank != self.rank and (state := self._process_state(rank)):
                    found[rank] = state
        except Exception:  # the store lives in rank 0 (or torchrun's agent): gone with it
            behind = [0] if self.rank != 0 else []
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        if found and not behind:  # it had reached the collective: killed or stopped inside it
            who = ", ".join(f"rank {r} ({'died' if state == 'gone' else 'stopped'})" for r, state in found.items())
            return (
                f"{who} of {self.world_size} during collective #{self.collectives} ({what}). "
                f"Rank {self.rank} stops too ({first[:MAX_CAUSE_CHARS]})."
            )
        if behind:
            who = ", ".join(f"rank {r}" for r in behind)
            return (
                f"{who} of {self.world_size} never reached collective #{self.collectives} ({what}): it died, or "
                f"hung for distributed.timeout_s={self.timeout_s:g} s (its own output says which). "
                f"Rank {self.rank} stops too ({first[:MAX_CAUSE_CHARS]})."
            )
        cause = first[:MAX_CAUSE_CHARS]
        return f"a rank of {self.world_size} failed during {what} ({cause}); rank {self.rank} stops too."

    def _process_state(self, rank: int) -> str | None:
        """ "gone" or "stopped" for a rank on this machine whose process has ended (a killed rank this
        process spawned stays a zombie until reaped) or is stopped (SIGSTOP); None otherwise or elsewhere."""
        host, _, pid = self.store.get(PROCESS_KEY.format(rank)).decode().partition(" ")
        if host != socket.gethostname() or not Path("/proc/self").exists():  # no /proc: not Linux
            return None
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:  # no such process
            return "gone"
        return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state)

    def gather(self, value) -> list:
        """`value` (plain data: numbers, strings, lists, dicts) from every rank, in rank order. It
        travels as JSON bytes in tensors: nothing a rank receives is unpickled."""
        return self._collective("gathering figures", lambda: self._gather_json(value))

    def _gather_json(self, value) -> list:
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.cpu_group)
        longest = max(int(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(data)] = data
        received = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(received, padded, group=self.cpu_group)
        return [json.loads(bytes(r[: int(n)].tolist())) for r, n in zip(received, sizes)]

    def average_gradients(self, params, figures: torch.Tensor) -> None:
        """Replaces each parameter's gradient, and `figures` (the loss terms), by their mean over the
        ranks: one all_reduce of one flat buffer. Parameters without a gradient are left out (the same
        ones on every rank: the model is the same)."""
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads] + [figures.reshape(-1).to(grads[0].dtype)])
        self._collective("averaging gradients", lambda: dist.all_reduce(flat))
        flat /= self.world_size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        figures.copy_(flat[offset:].view_as(figures))

    def sum_over_ranks(self, tensor: torch.Tensor) -> None:
        """Replaces `tensor` by its sum over the ranks, in place (the observation statistics' moments)."""
        self._collective("summing observation statistics", lambda: dist.all_reduce(tensor))

    def agree(self, steps: int, returns: list, stop_signal: int | None, wants_stop: bool) -> Agreement:
        """The update's global figures and whether every rank stops now (any rank asked to)."""
        everyone = self.gather((steps, returns, stop_signal, wants_stop))
        signals = [s for _, _, s, _ in everyone if s is not None]
        return Agreement(
            steps=sum(s for s, _, _, _ in everyone),
            returns=[r for _, rank_returns, _, _ in everyone for r in rank_returns],
            stop=any(w for _, _, _, w in everyone),
            stop_signal=signals[0] if signals else None,
        )

    def synchronise(self, model: torch.nn.Module, start_step: int, seed: int) -> None:
        """At start: rank 0's weights on every rank (whatever each initialised or loaded), and each
        other rank's own randomness (a resumed checkpoint holds rank 0's RNG state)."""
        for tensor in [*model.parameters(), *model.buffers()]:
            self._collective("sharing rank 0's weights", lambda t=tensor: dist.broadcast(t.data, src=0))
        if not self.is_main:
            seed_everything(seed + start_step)

    def check_same_config(self, cfg) -> None:
        """Refuses to start when the ranks' configs differ (each rank composed its own)."""
        mine = to_plain_dict(cfg)
        configs = self.gather(mine)
        for rank, theirs in enumerate(configs):
            differences = config_changes(theirs, mine)
            if differences:
                listed = "; ".join(
                    f"{key}: {old!r} on rank {rank}, {new!r} here" for key, (old, new) in differences.items()
                )
                raise ConfigError(
                    f"rank {self.rank}'s config differs from rank {rank}'s ({listed}): start every rank "
                    "with the same overrides."
                )

    def close(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # after a rank failed: nothing left to tidy
            pass


# -- setting a rank up ------------------------------------------------------------------------


def choose_backend(configured: str, device: torch.device, local_ranks: int, gpus: int) -> str:
    """nccl where each rank on a machine has a GPU of its own, else gloo: NCCL refuses two ranks on
    one GPU, while gloo all-reduces GPU tensors through host memory (slower, but it runs)."""
    wanted = DistBackend(configured)
    if wanted is DistBackend.auto:
        return "nccl" if device.type == "cuda" and local_ranks <= gpus else "gloo"
    if wanted is DistBackend.nccl and local_ranks > gpus:
        raise ConfigError(
            f"distributed.backend=nccl needs a GPU per rank, but {local_ranks} ranks share this machine's "
            f"{gpus} GPU{'s' if gpus != 1 else ''}: use distributed.backend=gloo (or auto), or fewer ranks per machine."
        )
    return wanted.value


def for_rank(cfg, ranks: Ranks, gpus: int):
    """This rank's copy of the config: its own seed and device (of the machine's `gpus`, 0 for a CPU
    learner); on ranks other than 0, no sinks and no evaluations (rank 0 writes the run dir). The
    ranks' configs were compared before this."""
    cfg.seed = rank_seed(cfg.seed, ranks.rank)
    if gpus:  # ranks beyond the GPUs share them, in turn (gloo)
        cfg.device = f"cuda:{ranks.local_rank % gpus}"
    if not ranks.is_main:
        cfg.logger.csv = False
        cfg.logger.tensorboard = False
        cfg.logger.wandb.mode = "disabled"
        cfg.eval.interval_steps = 0
        cfg.eval.final = False
        quiet_follower()
    registry.get(cfg.backend.name).for_rank(cfg.backend, ranks.local_rank)  # e.g. poly's server port
    return cfg


def quiet_follower() -> None:
    """A rank other than 0 writes no log file (rank 0's is the run's; under SLURM every task opened
    it) and says only warnings and errors: its own failure, or another rank's."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
    logging.getLogger("torchbeast_hydra").setLevel(logging.WARNING)


def shared_run_dir(ranks: Ranks, run_dir: Path) -> Path:
    """Rank 0's run dir, for every rank (under torchrun each rank's Hydra would name its own)."""
    return Path(ranks.gather(str(run_dir.resolve()))[0])


def setup(cfg, run_dir: Path) -> tuple:
    """Starts this rank: (its config, the run's dir, Ranks, the ranks it spawned or None)."""
    from torchbeast_hydra.run.devices import resolve_device

    spawned = spawn_others(cfg, run_dir)
    env = from_environment()
    device = resolve_device(cfg.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    backend = choose_backend(cfg.distributed.backend, device, env.local_world_size, gpus)
    ranks = Ranks(env, backend, cfg.distributed.timeout_s)
    run_dir = shared_run_dir(ranks, run_dir)
    ranks.check_same_config(cfg)
    return for_rank(cfg, ranks, gpus), run_dir, ranks, spawned
