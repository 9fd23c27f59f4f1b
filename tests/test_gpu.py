"""The GPU tier: what tests/test_gpu_ready.py shows with stand-ins, on a real CUDA device.

Every test here is marked `cuda` and skips, saying why, where torch sees no GPU; `make test` runs
them on a GPU machine (`pytest -m cuda` runs only them).
"""

from __future__ import annotations

import pytest
import torch

from torchbeast_hydra.backends import memory
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.run import checkpoint

from helpers import TINY, compose_config, run_cli

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)"),
]

LSTM2 = ["model.use_lstm=true", "model.lstm_layers=2"]


@pytest.mark.slow
@pytest.mark.parametrize("lstm", [False, True], ids=["feedforward", "lstm2"])
@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_both_backends_train_on_the_gpu(tmp_path, backend, lstm):
    run_dir = tmp_path / "run"
    run_cli(run_dir, *TINY, f"backend={backend}", "device=cuda", *(LSTM2 if lstm else []))
    state = checkpoint.load(checkpoint.path_in(run_dir))
    assert state["step"] >= 2560
    assert "cuda" in state["rng"]  # the GPU's generators are saved with the others
    info = (run_dir / "run_info.yaml").read_text()
    assert "cuda:" in info


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_resume_across_devices(tmp_path, backend):
    """A GPU-saved checkpoint goes on on a CPU, and that one on the GPU again."""
    run_dir = tmp_path / "run"
    common = [*TINY, f"backend={backend}", *LSTM2]
    run_cli(run_dir, *common, "device=cuda", "total_steps=640")
    run_cli(run_dir, *common, "device=cpu", "total_steps=1280")
    assert checkpoint.load(checkpoint.path_in(run_dir))["step"] >= 1280
    run_cli(run_dir, *common, "device=cuda", "total_steps=1920")
    assert checkpoint.load(checkpoint.path_in(run_dir))["step"] >= 1920


def test_cuda_rng_state_round_trips_through_a_checkpoint(tmp_path):
    torch.zeros(1, device="cuda")  # CUDA initialised, as in a GPU learner
    state = checkpoint.rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, dict(rng=state))
    expected = torch.rand(4, device="cuda")
    checkpoint.set_rng_state(checkpoint.load(path)["rng"])
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_the_memory_check_counts_the_gpu():
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import probe_env

    cfg = compose_config(["env=pong", "model=atari_net", "logger.wandb.mode=disabled"])
    spec = probe_env(cfg.env)
    model = make_model(cfg.model, spec)
    device = torch.device("cuda:0")
    needed = memory.check(cfg, spec, model, device)
    assert needed.gpu and needed.gpu_total > 0
    free, _ = torch.cuda.mem_get_info(device)
    cfg.batch_size = int(8 * free / needed.gpu["activations"]) + 1  # more activations than the GPU holds
    with pytest.raises(ConfigError, match="GPU memory on cuda:0"):
        memory.check(cfg, spec, model, device)


def test_a_cuda_index_beyond_the_gpus_is_one_clear_line(tmp_path):
    result = run_cli(tmp_path / "run", *TINY, f"device=cuda:{torch.cuda.device_count()}", check=False, timeout=60)
    assert result.returncode == 2
    (line,) = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert f"this machine has {torch.cuda.device_count()} CUDA device" in line


def learner_update(overrides, lstm=True) -> dict:
    from test_gpu_ready import fixed_batch

    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import probe_env
    from torchbeast_hydra.learning import accel
    from torchbeast_hydra.learning.learner import Learner

    cfg = compose_config(["env=pong", "model=atari_net", *(LSTM2 if lstm else ["model.use_lstm=false"]), *overrides])
    cfg.batch_size, cfg.unroll_length = 4, 10
    spec = probe_env(cfg.env)
    torch.manual_seed(0)
    accel.apply_switches(cfg.accel)
    try:
        learner = Learner(cfg, make_model(cfg.model, spec), torch.device("cuda"))
        batch = {key: value.cuda() for key, value in fixed_batch(cfg, spec).items()}
        return learner.update(batch, learner.model.initial_state(cfg.batch_size))
    finally:
        accel.apply_switches(compose_config([]).accel)


@pytest.mark.parametrize(
    "option, rel",
    [
        ("accel.cudnn_benchmark=true", 1e-4),
        ("accel.tf32=true", 1e-2),
        ("accel.bf16_autocast=true", 5e-2),
        ("accel.compile=true", 1e-3),
        ("accel.lstm_segments=false", 1e-4),
        ("accel.channels_last=false", 1e-4),
    ],
)
def test_each_speed_option_against_the_fp32_result(option, rel):
    fp32 = learner_update([])
    fast = learner_update([option])
    for key in ("total_loss", "pg_loss", "baseline_loss", "entropy_loss"):
        assert fast[key] == pytest.approx(fp32[key], rel=rel, abs=rel), (option, key)
