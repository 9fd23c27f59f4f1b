"""The memory estimate: what it counts, refusals before anything starts, and out-of-memory deaths in the log."""

import pytest
import torch

from torchbeast_hydra.agent.models import make_model
from torchbeast_hydra.backends import memory
from torchbeast_hydra.backends.mono.settings import num_buffers
from torchbeast_hydra.backends.settings import FORK_SERVER_BYTES
from torchbeast_hydra.env.spaces import probe_env
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.run.supervision import describe_exit

from helpers import TINY, compose_config, run_cli

GiB = memory.GiB


def estimate_for(*overrides):
    cfg = compose_config(overrides)
    spec = probe_env(cfg.env)
    return cfg, spec, make_model(cfg.model, spec)


def test_what_the_estimate_counts():
    cfg, spec, model = estimate_for("env=pong")
    assert memory.step_bytes(spec) == 4 * 84 * 84 + 4 + 1 + 4 + 4 + 8 + 1 + 8 + 4 * spec.actions.num_params + 4 + 8 + 1
    # atari_net on one frame: the float frame, then conv/relu/linear outputs (~0.3 MB)
    assert 0.25e6 < memory.activation_bytes(model, spec) < 0.35e6
    small = memory.estimate(cfg, spec, model)
    cfg.batch_size = 64
    big = memory.estimate(cfg, spec, model)
    grown = big.ram["learner batch and activations"] - small.ram["learner batch and activations"]
    per_sample = memory.ACTIVATION_FACTOR * memory.activation_bytes(model, spec) + 2 * memory.step_bytes(spec)
    assert grown == pytest.approx(56 * (cfg.unroll_length + 1) * per_sample, rel=1e-6)
    assert big.ram["rollout buffers"] == num_buffers(cfg) * (cfg.unroll_length + 1) * memory.step_bytes(spec)
    # weights, gradients and RMSProp's one slot (Adam: two); the actors share one more copy
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert big.ram["model"] == 3 * weights
    cfg.optim.name = "adam"
    assert memory.estimate(cfg, spec, model).ram["model"] == 4 * weights
    # a learner on a GPU: activations and the batch there, pinned batches in RAM
    on_gpu = memory.estimate(cfg, spec, model, on_gpu=True)
    assert set(on_gpu.gpu) == {"learner batch", "activations", "model"} and "learner batches" in on_gpu.ram
    # poly: no shared buffers; the learner queue and the clients instead
    cfg, spec, model = estimate_for("env=pong", "backend=poly")
    assert {"rollout queue", "env clients"} <= set(memory.estimate(cfg, spec, model).ram)
    cfg.backend.role = "env"
    assert set(memory.estimate(cfg, spec, model).ram) == {"env clients"}


@pytest.mark.parametrize("backend, part", [("mono", "actors"), ("poly", "env clients")])
def test_acting_processes_count_their_fork_server_once_and_their_own_memory_each(backend, part):
    cfg, spec, model = estimate_for("experiment=cartpole", f"backend={backend}", "backend.num_actors=1")
    one = memory.estimate(cfg, spec, model).ram[part]
    cfg.backend.num_actors = 9
    nine = memory.estimate(cfg, spec, model).ram[part]
    own = (nine - one) / 8
    assert 0 < own < 32 * 2**20  # forked: each only its own pages (a spawned one's imports were ~150 MB)
    assert one >= FORK_SERVER_BYTES + own  # the imports they share, counted once


def test_a_config_that_cannot_fit_is_refused_with_what_to_lower(monkeypatch):
    cfg, spec, model = estimate_for("env=pong", "batch_size=1000", "unroll_length=80")
    monkeypatch.setattr(memory, "available_ram", lambda: 20 * GiB)
    with pytest.raises(ConfigError) as error:
        memory.check(cfg, spec, model, torch.device("cpu"))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("this config needs about 4") and "but 20.0 GiB is available" in message
    assert "(learner batch and activations 40." in message and "lower batch_size or unroll_length" in message
    cfg.check_memory = False  # the way around an estimate that is wrong for this machine
    memory.check(cfg, spec, model, torch.device("cpu"))
    cfg.check_memory, cfg.batch_size, cfg.unroll_length = True, 8, 20
    memory.check(cfg, spec, model, torch.device("cpu"))  # the defaults fit


def test_refused_at_once_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(run_dir, "env=pong", "batch_size=100000", "logger.wandb.mode=disabled", check=False, timeout=60)
    assert result.returncode == 2
    (line,) = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert "this config needs about" in line and "lower batch_size or unroll_length" in line
    assert not (run_dir / "logs.csv").exists() and not (run_dir / "checkpoint.pt").exists()


def test_out_of_memory_in_the_learner_leaves_a_line_in_the_log(tmp_path):
    # Past the check (check_memory=false), the shared buffers cannot be allocated (~60 GB).
    run_dir = tmp_path / "run"
    result = run_cli(
        run_dir,
        *TINY,
        "env=pong",
        "model=atari_net",
        "batch_size=100000",
        "check_memory=false",
        check=False,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    log = (run_dir / "torchbeast.log").read_text()
    assert "error: out of memory in the learner process" in log and "Lower batch_size" in log
    assert "Traceback" not in result.stderr


def test_what_an_actor_death_says():
    assert describe_exit(1) == "died with exit code 1"
    assert "out-of-memory killer" in describe_exit(-9) and describe_exit(-9).startswith("died with exit code -9")
    assert memory.is_out_of_memory(MemoryError())
    assert memory.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate"))
    assert not memory.is_out_of_memory(RuntimeError("shape mismatch"))
