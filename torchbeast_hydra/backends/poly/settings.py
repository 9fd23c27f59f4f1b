"""PolyBeast's settings: the role, the ActorPool server's address, token, inference batching and
limits, and the address's parsing."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from torchbeast_hydra.backends.settings import FORK_SERVER_BYTES, BackendConfig
from torchbeast_hydra.errors import ConfigError, require

MiB = 1024**2
# An env client process's own memory (no model, no torch work), beside the fork server's
# (FORK_SERVER_BYTES; a spawned client's imports made it ~156 MB, not the 45 once calibrated here).
ENV_CLIENT_BYTES = 16 * MiB


class PolyRole(enum.Enum):
    all = "all"  # the learner plus local env clients
    learner = "learner"  # the learner and its ActorPool server only; clients connect from elsewhere
    env = "env"  # env clients only, connecting to a learner at backend.address


class LocalTransport(enum.Enum):
    """How role=all's own env clients, on the learner's machine, reach its ActorPool."""

    shared_memory = "shared_memory"  # shared tensors and semaphores (local.py): no gRPC framing
    grpc = "grpc"  # the wire remote clients use, over loopback


@dataclass
class PolyConfig(BackendConfig):
    """PolyBeast: the learner hosts an ActorPool gRPC server that runs the policy for every
    connected env client in dynamic batches and assembles their unrolls. Clients connect to it
    (it never dials out), from this machine (role=all) or others (role=env); see conf/backend/poly.yaml."""

    name: str = "poly"
    role: PolyRole = PolyRole.all
    # The ActorPool server's host:port. Loopback by default; 0.0.0.0:PORT serves other machines.
    # Port 0 picks a free port. The learner writes the address it serves on to
    # RUN_DIR/actorpool_address; role=env takes HOST:PORT, or file:PATH to read it from there
    # (e.g. on a shared filesystem, waiting for the file to appear).
    address: str = "127.0.0.1:0"
    # Clients must present this shared secret. Prefer the TORCHBEAST_TOKEN environment variable,
    # which stays out of the saved config; role=all makes a random one when neither is set.
    token: Optional[str] = None
    # Central inference: up to max_batch_size envs per forward pass, waiting at most
    # batch_timeout_ms after the first request for others to join.
    max_batch_size: int = 64
    batch_timeout_ms: float = 2.0
    # Finished rollouts waiting for the learner (bounds memory); producers wait when it is full.
    learner_queue_size: int = 64
    cut_at_reset: bool = True  # an env reset ends its rollout early (a partial, masked rollout)
    max_clients: int = 64  # concurrent client streams the server accepts; more are refused with a message naming this
    # A stream the server waits on longer is dropped (its envs' unrolls go on, partial).
    client_idle_timeout_s: float = 60.0
    # Remote clients send each env's newest frame alone where the rest of its stack of frames (Atari's
    # last 4 screens) is what they sent the step before: 4x fewer bytes (frame_stacks.py). false: whole stacks.
    newest_frames: bool = True
    max_envs_per_client: int = 256  # sizes the gRPC message limit: larger steps are refused
    connect_timeout_s: float = 60.0  # clients wait this long for a learner that is not up (yet)
    inference_torch_threads: int = 1  # intra-op threads for central inference
    # role=all's env clients: over shared memory (no gRPC framing; the same checks, sessions and
    # seeds), or over gRPC on loopback as remote clients connect. role=env always speaks gRPC.
    local_transport: LocalTransport = LocalTransport.shared_memory
    # Processes the server's work (wire decoding, checks, unroll assembly) is spread over, each with
    # its own GIL, all serving on backend.address; central inference stays one batched pass in the
    # learner. 0: one process for role=all's own clients on shared memory, else one per 4 cores
    # (1 below 8 cores); 1: all in the learner's process.
    server_shards: int = 0
    # How long a thread of the learner's process (and of each shard) may hold the GIL while another
    # waits for it (sys.setswitchinterval), in ms; null: Python's 5. Central inference's thread
    # gives the GIL up at every wait (its GPU pass, its batch) and may wait up to this long to take
    # it back from a thread running plain Python (the serving loop, the learner's bookkeeping).
    gil_switch_interval_ms: Optional[float] = None


ADDRESS_FILE_PREFIX = "file:"


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[::1]:port') -> (host, port); raises ConfigError naming backend.address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"backend.address={address!r}: use HOST:PORT, e.g. 127.0.0.1:4431.")
    return host, int(port)


def check(cfg) -> None:
    """poly's slice: the address for the role, the server's sizes and limits."""
    backend = cfg.backend
    role = PolyRole(backend.role)
    if role is PolyRole.env and backend.address.startswith(ADDRESS_FILE_PREFIX):
        require(len(backend.address) > len(ADDRESS_FILE_PREFIX), "backend.address=file:PATH needs a path.")
    else:
        _, port = split_address(backend.address)
        require(
            role is not PolyRole.env or port != 0,
            "backend.role=env needs the learner's address: backend.address=HOST:PORT (or file:PATH).",
        )
    for key in ("max_batch_size", "learner_queue_size", "max_clients"):
        require(backend[key] >= 1, f"backend.{key} must be at least 1.")
    require(backend.batch_timeout_ms >= 0, "backend.batch_timeout_ms must be >= 0.")
    require(backend.connect_timeout_s > 0, "backend.connect_timeout_s must be positive.")
    require(backend.client_idle_timeout_s > 0, "backend.client_idle_timeout_s must be positive.")
    require(backend.server_shards >= 0, "backend.server_shards must be >= 0 (0: from the cores).")
    require(
        backend.gil_switch_interval_ms is None or backend.gil_switch_interval_ms > 0,
        "backend.gil_switch_interval_ms must be positive (or null: Python's 5 ms).",
    )
    require(backend.inference_torch_threads >= 1, "backend.inference_torch_threads must be at least 1.")
    require(backend.max_envs_per_client >= 1, "backend.max_envs_per_client must be at least 1.")
    require(
        not backend.synchronous or backend.server_shards <= 1,
        "backend.synchronous=true keeps poly's server in the learner's process: set backend.server_shards=1 (or 0).",
    )
    if backend.synchronous:  # sessions wait at whole unrolls' ends, for the envs the learner knows
        require(role is PolyRole.all, "backend.synchronous=true needs backend.role=all (the learner's own envs).")
        require(not backend.cut_at_reset, "backend.synchronous=true needs backend.cut_at_reset=false (whole unrolls).")
    require(
        backend.envs_per_actor <= backend.max_envs_per_client,
        f"backend.envs_per_actor={backend.envs_per_actor} is above backend.max_envs_per_client="
        f"{backend.max_envs_per_client}, which sizes the message limit: raise it.",
    )


def auto_actors(cores: int) -> tuple[int, int]:
    """(num_actors, envs_per_actor) for a machine with this many cores: a client per 4 cores, at
    least 2 (each steps its envs on cores // clients native threads, Atari), with 4 envs per thread
    in each message and at least 16: many envs per message keeps the server's per-message cost
    small (2 cores: 2 x 16, not 4 x 4: +35%; docs/performance.md)."""
    clients = max(2, cores // 4)
    return clients, max(16, 4 * (cores // clients))


def learns(backend) -> bool:
    """role=env runs env clients only: no learner, no run state, no memory check."""
    return PolyRole(backend.role) is not PolyRole.env


# A local client's sets of unroll rows in shared memory, which it writes itself (local.py), where
# the learner is lent them: one being written, two with the learner; with none free, rows are copied.
LOCAL_ROW_SETS = 3


def memory(cfg, unroll_bytes: int, envs_bytes: int, weight_bytes: int) -> dict:
    """What poly keeps in RAM beside the learner (backends/memory.py): the learner's queue of
    rollouts and, with role=all, its own env clients and their unrolls in progress (remote
    clients' envs are unknown here; a local client over shared memory has LOCAL_ROW_SETS of them);
    role=env: the env clients alone."""
    backend = cfg.backend
    role = PolyRole(backend.role)
    clients = FORK_SERVER_BYTES + backend.num_actors * ENV_CLIENT_BYTES + envs_bytes
    if role is PolyRole.env:
        return {"env clients": clients}
    in_progress = backend.num_actors * backend.envs_per_actor if role is PolyRole.all else 0
    if LocalTransport(backend.local_transport) is LocalTransport.shared_memory:
        in_progress *= LOCAL_ROW_SETS
    parts = {"rollout queue": (backend.learner_queue_size + in_progress) * unroll_bytes}
    if role is PolyRole.all:
        parts["env clients"] = clients
    return parts


def for_rank(backend, local_rank: int) -> None:
    """A data-parallel rank's server address: a fixed port is rank 0's, and each rank on a machine
    serves its own (the next ports); port 0 picks a free one anyway."""
    host, _, port = backend.address.rpartition(":")
    if port.isdigit() and int(port) != 0:
        backend.address = f"{host}:{int(port) + local_rank}"
