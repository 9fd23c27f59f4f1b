"""How much memory a config needs, checked against the machine before any process starts.

The estimate adds up what grows with the config: the rollout storage and acting processes (each
backend's memory(): mono's shared buffers, poly's learner queue and unrolls in progress), the
learner's batches and the activations of its forward and backward pass, the model with its
gradients and optimiser state. The activations are measured, not guessed: the model runs once on one
sample with hooks that add up what each layer outputs. The constants below were calibrated
against peak PSS of real runs (`python benchmarks/memory.py`), so that configs that run pass
and configs that cannot fit fail at once, with one line saying what to lower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchbeast_hydra.backends import registry
from torchbeast_hydra.env.layout import rollout_specs
from torchbeast_hydra.env.make import is_atari
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.errors import ConfigError

GiB = 1024**3
MiB = 1024**2

# Calibrated on peak PSS of whole runs (benchmarks/memory.py) and on the peak RSS of single
# learner updates (torch 2.13 CPU, Python 3.11); the figures are in benchmarks/memory.py.
# Each backend's acting processes: its settings module (mono/settings.py, poly/settings.py).
LEARNER_PROCESS = 450 * MiB  # Python + torch + gymnasium + ale-py imported, before any tensor
ATARI_ENV = 6 * MiB  # one ALE emulator with its preprocessing wrappers
# The update's peak over what the layers output (measured 1.15-1.6x with atari_net and resnet: the
# backward pass's gradients, the float copy of the frames, the allocator's cached blocks), plus
# a fixed part (thread pools, allocator arenas) that dominates only tiny models.
ACTIVATION_FACTOR = 1.6
UPDATE_OVERHEAD = 64 * MiB
LEARNER_BATCHES = 2  # batches alive at once: one being gathered, one in the update


@dataclass
class Estimate:
    """Bytes per part: `ram` for the machine's memory, `gpu` for the learner's GPU (if it has one)."""

    ram: dict = field(default_factory=dict)
    gpu: dict = field(default_factory=dict)

    @property
    def ram_total(self) -> int:
        return sum(self.ram.values())

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())


def step_bytes(spec: EnvSpec) -> int:
    """One time step of one env in the rollout layout (every observation leaf, reward, logits, ...)."""
    total = 0
    for shape, dtype in rollout_specs(spec).values():
        numel = 1
        for size in shape:
            numel *= size
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def activation_bytes(model: torch.nn.Module, spec: EnvSpec) -> int:
    """What one sample's forward pass produces: the float input plus every layer's outputs."""
    total = 0

    def count(module, inputs, output):
        nonlocal total
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()

    hooks = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    inputs = {key: torch.zeros((1, 1, *shape), dtype=dtype) for key, (shape, dtype) in rollout_specs(spec).items()}
    try:
        with torch.no_grad():
            model(inputs, model.initial_state(1), action="none")
    finally:
        for hook in hooks:
            hook.remove()
    numel = sum(math.prod(leaf.shape) for leaf in spec.leaves)
    return total + 4 * numel  # the observation as float32, every leaf


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def optimizer_slots(name) -> int:
    """Tensors of state per weight: RMSProp keeps one, Adam two."""
    return 2 if str(getattr(name, "value", name)) == "adam" else 1


def estimate(cfg, spec: EnvSpec, model: torch.nn.Module, on_gpu: bool = False) -> Estimate:
    """The memory the config needs, by part. on_gpu: the learner's model and batches live on a GPU."""
    backend = cfg.backend
    unroll = (cfg.unroll_length + 1) * step_bytes(spec)
    samples = cfg.batch_size * (cfg.unroll_length + 1)
    weights = weight_bytes(model)
    learner = weights * (2 + optimizer_slots(cfg.optim.name))  # weights, gradients, optimiser state
    activations = int(ACTIVATION_FACTOR * samples * activation_bytes(model, spec)) + UPDATE_OVERHEAD
    batch = cfg.batch_size * unroll
    per_env = ATARI_ENV if is_atari(cfg.env.id) else 0
    kind = registry.get(backend.name)
    beside_learner = kind.memory(cfg, unroll, backend.num_actors * backend.envs_per_actor * per_env, weights)

    result = Estimate()
    if not kind.learns(backend):  # acting processes only (poly's role=env)
        result.ram.update(beside_learner)
        return result
    result.ram["learner process"] = LEARNER_PROCESS
    result.ram.update(beside_learner)
    batches = LEARNER_BATCHES * batch
    if on_gpu:
        result.ram["learner batches"] = batches  # pinned host copies
        result.gpu["learner batch"] = batch
        result.gpu["activations"] = activations
        result.gpu["model"] = learner
    else:
        result.ram["learner batch and activations"] = batches + activations
        result.ram["model"] = learner
    return result


# What to lower for each part: the config keys that size it.
REMEDIES = {
    "learner batch and activations": "batch_size or unroll_length",
    "activations": "batch_size or unroll_length",
    "learner batch": "batch_size or unroll_length",
    "learner batches": "batch_size or unroll_length",
    "rollout buffers": "backend.num_buffers (null: twice the envs, num_actors x envs_per_actor), or batch_size",
    "rollout queue": "backend.learner_queue_size or the envs (backend.num_actors x envs_per_actor)",
    "actors": "backend.num_actors (or backend.envs_per_actor)",
    "env clients": "backend.num_actors (or backend.envs_per_actor)",
    "model": "the model's size",
    "learner process": "nothing: this is the learner's own baseline",
}


def available_ram() -> int | None:
    """Memory that can be had without swapping: MemAvailable, bounded by this process's cgroup (v2)
    limit, as under SLURM's task/cgroup or a container's memory limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    left = cgroup_memory_left()
    if left is not None:
        available = left if available is None else min(available, left)
    return available


def cgroup_memory_left() -> int | None:
    """Limit - usage of this process's memory cgroup (v2, else v1); None without a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            group, files = Path("/sys/fs/cgroup", path.lstrip("/")), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            group, files = (
                Path("/sys/fs/cgroup/memory", path.lstrip("/")),
                ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            )
        else:
            continue
        try:
            limit = (group / files[0]).read_text().strip()
            if limit != "max" and int(limit) < 2**60:  # v1 writes "no limit" as a huge number
                return int(limit) - int((group / files[1]).read_text())
        except (OSError, ValueError):
            continue
    return None


def available_gpu(device: torch.device) -> int | None:
    try:
        free, _ = torch.cuda.mem_get_info(device)
        return free
    except (RuntimeError, AssertionError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def summary(needed: Estimate, copies: int = 1) -> str:
    """One line for the log: the total and the parts; copies: data-parallel ranks on this machine."""
    if copies > 1:
        return f"{copies} ranks on this machine x ({summary(needed)})"

    def listed(parts):
        return ", ".join(f"{name} {_gib(size)}" for name, size in sorted(parts.items(), key=lambda kv: -kv[1]))

    text = f"{_gib(needed.ram_total)} of memory ({listed(needed.ram)})"
    if needed.gpu:
        text += f"; {_gib(needed.gpu_total)} on the GPU ({listed(needed.gpu)})"
    return text


def _refusal(where: str, parts: dict, total: int, available: int) -> str:
    largest = max(parts, key=parts.get)
    listed = ", ".join(f"{name} {_gib(size)}" for name, size in sorted(parts.items(), key=lambda kv: -kv[1]))
    return (
        f"this config needs about {_gib(total)} of {where} ({listed}) but {_gib(available)} is available: "
        f"lower {REMEDIES.get(largest, largest)}, or set check_memory=false to start anyway."
    )


def check(cfg, spec: EnvSpec, model: torch.nn.Module, device: torch.device, copies: int = 1) -> Estimate:
    """Raises ConfigError when the config cannot fit this machine's memory (or the learner's GPU).

    copies: data-parallel ranks on this machine, each with its own learner and actors (one GPU each)."""
    on_gpu = device.type == "cuda"
    needed = estimate(cfg, spec, model, on_gpu)
    if not cfg.check_memory:
        return needed
    ram = available_ram()
    if ram is not None and needed.ram_total * copies > ram:
        where = "memory" if copies == 1 else f"memory for each of {copies} ranks on this machine"
        raise ConfigError(_refusal(where, needed.ram, needed.ram_total, ram // copies))
    gpu = available_gpu(device) if on_gpu else None
    if gpu is not None and needed.gpu_total > gpu:
        raise ConfigError(_refusal(f"GPU memory on {device}", needed.gpu, needed.gpu_total, gpu))
    return needed


def is_out_of_memory(error: BaseException) -> bool:
    """A MemoryError, a CUDA OOM, or torch's CPU allocator giving up."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
