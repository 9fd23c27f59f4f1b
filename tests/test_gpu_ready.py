"""What must hold on a GPU, shown on a CPU with stand-ins for CUDA's rules and failures
(tests/cuda_stand_ins): the LSTM state cuDNN accepts, a failing model stopping either backend with
one clear line, the original error reported when saving fails too, the learner's device choices,
weights published at an interval, and the speed options against the fp32 result.
(tests/test_gpu.py runs the real thing where there is a GPU.)"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from torchbeast_hydra.agent.models import ActorCritic, MLPBody
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.learning import accel
from torchbeast_hydra.run import checkpoint, devices

from helpers import TINY, cli_env_with_path, compose_config, run_cli, run_command

STAND_INS = Path(__file__).resolve().parent / "cuda_stand_ins"
LSTM2 = ["model.use_lstm=true", "model.lstm_layers=2"]


def stand_in_env(**variables: str) -> dict:
    """The CLI's environment with the stand-ins importable (and sitecustomize run) in every process."""
    return cli_env_with_path(STAND_INS, **variables)


@pytest.fixture
def cudnn_rnn_rule(monkeypatch):
    """In this process: nn.LSTM refuses a non-contiguous hidden state, as cuDNN does."""
    forward = torch.nn.LSTM.forward

    def as_cudnn(self, input, hx=None):
        if hx is not None and not all(h.is_contiguous() for h in hx):
            raise RuntimeError("rnn: hx is not contiguous")
        return forward(self, input, hx)

    monkeypatch.setattr(torch.nn.LSTM, "forward", as_cudnn)


def lstm_model(layers=2, obs=4, actions=3) -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(MLPBody((obs,), (16,)), actions, use_lstm=True, lstm_layers=layers)


def model_inputs(T: int, B: int, done: torch.Tensor | None = None, obs=4, actions=3) -> dict:
    return dict(
        frame=torch.randn(T, B, obs),
        reward=torch.randn(T, B),
        done=torch.zeros(T, B, dtype=torch.bool) if done is None else done,
        last_action=torch.randint(actions, (T, B)),
    )


# -- the LSTM's hidden state ---------------------------------------------------------------------


def test_a_strided_hidden_state_passes_the_cudnn_rule(cudnn_rnn_rule):
    model = lstm_model()
    # As poly batches states across clients: [envs, layers, hidden] transposed to [layers, envs, hidden].
    state = tuple(torch.randn(5, 2, model.lstm.hidden_size).transpose(0, 1) for _ in range(2))
    assert not state[0].is_contiguous()
    with torch.no_grad():
        model(model_inputs(1, 5), state)  # raised "rnn: hx is not contiguous" before the fix
        model(model_inputs(4, 5, done=torch.rand(4, 5) < 0.3), state)


def test_poly_inference_hands_back_state_the_next_call_accepts(cudnn_rnn_rule):
    from torchbeast_hydra.backends.poly.backend import CentralInference, PolyBeast

    backend = PolyBeast.__new__(PolyBeast)  # only what _initial_state needs
    backend.policy = lstm_model()
    backend.policy.eval()
    infer = CentralInference(backend.policy, threading.Lock(), publisher=None, device=torch.device("cpu"))
    state = backend._initial_state(3)
    for _ in range(3):
        inputs = {key: value[0] for key, value in model_inputs(1, 3).items()}
        inputs.update({f"core_state_{i}": s for i, s in enumerate(state)})
        outputs = infer(inputs)
        state = tuple(outputs[f"core_state_{i}"] for i in range(2))
    assert state[0].shape == (3, 2, backend.policy.lstm.hidden_size)


def test_initial_state_is_built_on_the_models_device():
    model = lstm_model().to("meta")  # a device other than the CPU, here
    assert all(s.device.type == "meta" for s in model.initial_state(2))
    assert all(s.device.type == "cpu" for s in model.initial_state(2, device="cpu"))


@pytest.mark.parametrize("done_rate", [0.0, 0.1, 0.5, 1.0])
def test_lstm_segments_equal_the_step_loop(done_rate):
    model = lstm_model()
    torch.manual_seed(1)
    done = torch.rand(20, 6) < done_rate
    inputs = model_inputs(20, 6, done)
    state = tuple(torch.randn_like(s) for s in model.initial_state(6))
    results = []
    for segments in (False, True):
        model.lstm_segments = segments
        outputs, final = model(inputs, state, action="none")
        results.append((outputs, final))
    (loop, loop_state), (fused, fused_state) = results
    for key in loop:
        torch.testing.assert_close(fused[key], loop[key], rtol=1e-5, atol=1e-6)
    for a, b in zip(loop_state, fused_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The gradients too: the learner differentiates through it.
    grads = []
    for segments in (False, True):
        model.zero_grad()
        model.lstm_segments = segments
        model(inputs, state, action="none")[0]["baseline"].sum().backward()
        grads.append([p.grad.clone() for p in model.lstm.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# -- device choice and host threads --------------------------------------------------------------


def test_a_cuda_device_is_refused_clearly_where_there_is_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available here"):
        devices.resolve_device("cuda:0")


def test_a_cuda_index_beyond_the_machines_gpus_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"device=cuda:3 but this machine has 1 CUDA device \(cuda:0;") as refused:
        devices.resolve_device("cuda:3")
    assert "\n" not in str(refused.value)
    assert devices.resolve_device("cuda:0") == torch.device("cuda:0")


def test_a_gpu_learner_leaves_the_cores_to_the_actors(monkeypatch):
    monkeypatch.setattr(devices, "usable_cores", lambda: 32)
    assert devices.learner_threads(0, torch.device("cpu")) == 32
    assert devices.learner_threads(0, torch.device("cuda:0")) == devices.GPU_LEARNER_THREADS
    assert devices.learner_threads(5, torch.device("cuda:0")) == 5


def test_a_cpu_learner_in_bf16_takes_one_thread_where_the_actors_fill_the_cores(monkeypatch):
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    cpu = torch.device("cpu")
    assert devices.learner_threads(0, cpu, bf16=True, actor_processes=2) == 1
    assert devices.learner_threads(0, cpu, bf16=False, actor_processes=2) == 2  # fp32: the learner is the slower
    assert devices.learner_threads(0, cpu, bf16=True, actor_processes=1) == 2  # a core to spare
    assert devices.learner_threads(0, cpu, bf16=True, actor_processes=0) == 2  # poly role=learner
    assert devices.learner_threads(3, cpu, bf16=True, actor_processes=2) == 3  # as configured


def test_bf16_autocast_left_at_auto_is_on_only_where_it_pays(monkeypatch):
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import probe_env

    def uses_bf16(overrides, device="cpu"):
        cfg = compose_config(["env=pong", *overrides])
        return accel.uses_bf16(cfg.accel, torch.device(device), make_model(cfg.model, probe_env(cfg.env)))

    assert compose_config(["env=pong"]).accel.bf16_autocast is None  # auto, the default
    monkeypatch.setattr(accel, "native_bf16", lambda: True)
    assert uses_bf16([]) and uses_bf16(["model=resnet"])  # conv-heavy bodies on a CPU with bf16 math
    assert not uses_bf16([], device="cuda")  # a GPU learner keeps float32 unless asked
    cartpole = compose_config(TINY)
    assert not accel.uses_bf16(cartpole.accel, torch.device("cpu"), make_model(cartpole.model, probe_env(cartpole.env)))
    monkeypatch.setattr(accel, "native_bf16", lambda: False)
    assert not uses_bf16([])  # emulated bf16 gains nothing
    assert uses_bf16(["accel.bf16_autocast=true"]) and not uses_bf16(["accel.bf16_autocast=false"])


def test_acting_in_bf16_follows_the_learner_unless_set():
    cfg = compose_config(TINY).accel
    assert cfg.bf16_acting is None  # the default
    assert accel.acts_in_bf16(cfg, learner_bf16=True) and not accel.acts_in_bf16(cfg, learner_bf16=False)
    cfg.bf16_acting = False
    assert not accel.acts_in_bf16(cfg, learner_bf16=True)
    cfg.bf16_acting = True
    assert accel.acts_in_bf16(cfg, learner_bf16=False)


def test_poly_inference_in_bf16_samples_from_fp32_heads_and_sees_each_new_weight():
    from torchbeast_hydra.backends.poly.backend import CentralInference, PolyBeast

    backend = PolyBeast.__new__(PolyBeast)  # only what _initial_state needs
    backend.policy = policy = lstm_model().eval()
    inputs = {key: value[0] for key, value in model_inputs(1, 3).items()}
    inputs.update({f"core_state_{i}": s for i, s in enumerate(backend._initial_state(3))})
    fp32 = CentralInference(policy, threading.Lock(), publisher=None, device=torch.device("cpu"))(inputs)
    infer = CentralInference(policy, threading.Lock(), publisher=None, device=torch.device("cpu"), bf16=True)
    bf16 = infer(inputs)
    for key in ("policy_logits", "baseline"):
        assert bf16[key].dtype == torch.float32, key
        assert torch.allclose(bf16[key], fp32[key], atol=0.05) and not torch.equal(bf16[key], fp32[key]), key
    with torch.no_grad():  # new weights, as the learner publishes them
        for parameter in policy.parameters():
            parameter.zero_()
    assert (infer(inputs)["policy_logits"] == 0).all()  # not a bf16 copy of the old ones


def test_cuda_errors_are_told_from_others():
    assert devices.is_cuda_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not devices.is_cuda_error(RuntimeError("shapes do not match"))
    assert not devices.is_cuda_error(torch.cuda.OutOfMemoryError("CUDA out of memory."))


def test_the_step_count_and_returns_come_from_the_cpu_batch():
    from torchbeast_hydra.run.training_run import TrainingRun

    mask = torch.ones(5, 2, dtype=torch.bool)
    mask[3:, 1] = False
    episode_end = torch.zeros(5, 2, dtype=torch.bool)
    episode_end[2, 0] = episode_end[4, 1] = True  # the second is padding
    batch = dict(mask=mask, episode_end=episode_end, episode_return=torch.arange(10.0).view(5, 2))
    assert TrainingRun.batch_figures(batch) == (6, [4.0])


# -- checkpoints across devices ------------------------------------------------------------------


def test_a_gpu_saved_rng_state_resumes_on_a_cpu():
    state = checkpoint.rng_state()
    assert "cuda" not in state  # CUDA untouched in this process
    expected = torch.rand(3)
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]  # as a GPU learner saves it
    checkpoint.set_rng_state(state)  # ignored here, where there is no such device
    assert torch.equal(torch.rand(3), expected)


# -- publishing weights --------------------------------------------------------------------------


def test_weights_reach_the_policy_every_publish_interval_updates():
    from torchbeast_hydra.run.publish import WeightPublisher

    learner, policy = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    publisher = WeightPublisher(learner, policy, threading.Lock(), threading.Lock(), interval=3)
    assert publisher.mode == "cpu"
    publisher.publish_now()
    for update in range(1, 7):
        with torch.no_grad():
            learner.weight.add_(1.0)
        publisher.after_update()
        assert torch.equal(policy.weight, learner.weight) == (update % 3 == 0)
    publisher.close()


# -- speed options -------------------------------------------------------------------------------


def learner_stats(overrides, lstm=True):
    """The first update's figures of a fresh learner on a fixed batch."""
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import probe_env
    from torchbeast_hydra.learning.learner import Learner

    cfg = compose_config([*TINY, *(LSTM2 if lstm else []), *overrides])
    spec = probe_env(cfg.env)
    torch.manual_seed(0)
    learner = Learner(cfg, make_model(cfg.model, spec), torch.device("cpu"))
    batch = fixed_batch(cfg, spec)
    return learner.update(batch, learner.model.initial_state(cfg.batch_size))


def fixed_batch(cfg, spec: EnvSpec) -> dict:
    from torchbeast_hydra.env.layout import rollout_specs

    generator = torch.Generator().manual_seed(5)
    T, B = cfg.unroll_length + 1, cfg.batch_size
    batch = {}
    for key, (shape, dtype) in rollout_specs(spec).items():
        if dtype == torch.bool:
            batch[key] = torch.rand((T, B, *shape), generator=generator) < 0.1
        elif dtype.is_floating_point:
            batch[key] = torch.randn((T, B, *shape), generator=generator, dtype=dtype)
        else:
            batch[key] = torch.randint(spec.actions.nvec[0], (T, B, *shape), generator=generator, dtype=dtype)
    batch["mask"][:] = True
    return batch


def test_bf16_autocast_keeps_the_losses_in_fp32_near_the_fp32_result():
    fp32 = learner_stats([])
    bf16 = learner_stats(["accel.bf16_autocast=true"])
    for key in ("total_loss", "pg_loss", "baseline_loss", "entropy_loss"):
        assert bf16[key] == pytest.approx(fp32[key], rel=0.05, abs=0.05), key
    assert fp32 != bf16  # it did run in bf16


def test_lstm_segments_give_the_step_loops_update():
    loop = learner_stats(["accel.lstm_segments=false"])
    fused = learner_stats(["accel.lstm_segments=true"])
    for key in ("total_loss", "grad_norm"):
        assert fused[key] == pytest.approx(loop[key], rel=1e-5), key


def test_switches_apply_process_wide():
    cfg = compose_config([*TINY, "accel.cudnn_benchmark=true", "accel.tf32=true"]).accel
    try:
        accel.apply_switches(cfg)
        assert torch.backends.cudnn.benchmark and torch.backends.cuda.matmul.allow_tf32
    finally:
        accel.apply_switches(compose_config(TINY).accel)
    assert not torch.backends.cudnn.benchmark and not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.slow
def test_compile_gives_the_eager_update():
    pytest.importorskip("torch._dynamo")
    eager = learner_stats([], lstm=False)
    compiled = learner_stats(["accel.compile=true"], lstm=False)
    for key in ("total_loss", "grad_norm"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-4), key


def test_publish_interval_is_checked():
    from torchbeast_hydra.config import validate

    cfg = compose_config([*TINY, "backend.publish_interval=0"])
    with pytest.raises(ConfigError, match="backend.publish_interval must be at least 1"):
        validate(cfg)


# -- failures: one clear line, the checkpoint intact ---------------------------------------------


def test_one_line_for_each_device_failure():
    from torchbeast_hydra.__main__ import failure_line

    oom, traceback = failure_line(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"))
    assert oom.startswith("CUDA out of memory on the learner's GPU (CUDA out of memory. Tried to allocate 2.00 GiB)")
    assert "Lower batch_size" in oom and not traceback
    assert failure_line(MemoryError())[0].startswith("out of memory in the learner process")
    gpu, traceback = failure_line(RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors ..."))
    assert gpu.startswith("the GPU failed (RuntimeError: CUDA error: device-side assert triggered)")
    assert "CUDA_LAUNCH_BLOCKING=1" in gpu and traceback
    bug, traceback = failure_line(ValueError("bad shapes"))
    assert bug.startswith("the run stopped on ValueError: bad shapes") and traceback
    assert all("\n" not in line for line in (oom, gpu, bug))


def test_a_failure_that_breaks_saving_too_is_what_gets_reported(tmp_path, caplog):
    """A sticky CUDA error makes the final checkpoint's save fail as well: the learner's error is
    raised, not the save's, and the previous checkpoint stays."""
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.backends.loop import Backend
    from torchbeast_hydra.env.spaces import probe_env
    from torchbeast_hydra.run.training_run import TrainingRun

    cfg = compose_config(TINY)
    run = TrainingRun(cfg, tmp_path, probe_env(cfg.env))
    run.save_checkpoint()
    saved = run.checkpoint_path.read_bytes()
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")

    class Failing(Backend):
        def start(self):
            pass

        def wait(self, timeout):
            time.sleep(timeout)

        def next_batch(self):
            raise sticky

        def shut_down(self):
            pass

    def save_fails():
        raise RuntimeError("CUDA error: an illegal memory access was encountered (while saving)")

    backend = Failing(cfg, run, make_model(cfg.model, run.spec))
    run.save_checkpoint = save_fails
    with pytest.raises(RuntimeError) as raised:
        backend.train()
    assert raised.value is sticky
    assert "Could not save a final checkpoint" in caplog.text
    assert run.checkpoint_path.read_bytes() == saved
    run.close()


def failing_run(tmp_path, backend, fail_in, fail_after, fail_with="bug", extra=()):
    run_dir = tmp_path / f"{backend}-{fail_with}"
    started = time.monotonic()
    result = run_cli(
        run_dir,
        *TINY,
        f"backend={backend}",
        "model._target_=failing_models.FailingBody",
        "total_steps=1000000",
        "backend.num_actors=1",
        *extra,
        check=False,
        timeout=120,
        env=stand_in_env(TBH_FAIL_IN=fail_in, TBH_FAIL_AFTER=str(fail_after), TBH_FAIL_WITH=fail_with),
    )
    return run_dir, result, time.monotonic() - started


def error_lines(run_dir) -> list:
    """The log's own error lines (not a traceback's)."""
    return [line for line in (run_dir / "torchbeast.log").read_text().splitlines() if "] - error: " in line]


@pytest.mark.slow
def test_a_model_failing_in_poly_inference_stops_the_run_with_one_line_and_a_checkpoint(tmp_path):
    # Before: clients took the failure for a lost connection and reconnected forever; the learner
    # waited at step 0 (the test's timeout).
    run_dir, result, seconds = failing_run(tmp_path, "poly", "inference", 400)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = error_lines(run_dir)
    assert "error: the run stopped on ValueError: a bug in the model" in line
    log = (run_dir / "torchbeast.log").read_text()
    assert "Traceback" in log and "failing_models.py" in log
    state = checkpoint.load(checkpoint.path_in(run_dir))
    assert state["step"] > 0  # updates ran before the failure, and their result is kept
    assert seconds < 60


@pytest.mark.slow
def test_a_model_failing_in_the_mono_learner_stops_the_run_the_same_way(tmp_path):
    run_dir, result, _ = failing_run(tmp_path, "mono", "update", 3)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = error_lines(run_dir)
    assert "error: the run stopped on ValueError: a bug in the model" in line
    assert checkpoint.load(checkpoint.path_in(run_dir))["step"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "fail_with, says",
    [
        ("oom", "error: CUDA out of memory on the learner's GPU (CUDA out of memory. Tried to allocate 2.00 GiB)"),
        ("assert", "error: the GPU failed (AcceleratorError: CUDA error: device-side assert triggered)"),
    ],
)
def test_a_device_failure_mid_run_is_one_clear_line(tmp_path, fail_with, says):
    run_dir, result, _ = failing_run(tmp_path, "poly", "update", 2, fail_with)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = error_lines(run_dir)
    assert says in line, line
    assert checkpoint.load(checkpoint.path_in(run_dir))["step"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mono", "poly"])
def test_a_two_layer_lstm_trains_under_cudnns_rule(tmp_path, backend):
    # Before: poly sat at step 0 (every inference raised "rnn: hx is not contiguous").
    # Also each backend's end-to-end LSTM run (one layer takes the same path as two).
    run_dir = tmp_path / backend
    run_cli(
        run_dir, *TINY, f"backend={backend}", *LSTM2, "total_steps=640", env=stand_in_env(TBH_EMULATE_CUDNN_RNN="1")
    )
    assert checkpoint.load(checkpoint.path_in(run_dir))["step"] >= 640


def test_the_cudnn_stand_in_refuses_what_cudnn_refuses(tmp_path):
    """The stand-in itself, in a fresh process: it must fail on what the fix avoids."""
    code = (
        "import torch; lstm = torch.nn.LSTM(3, 4, num_layers=2); "
        "s = torch.zeros(2, 2, 4).transpose(0, 1); "
        "lstm(torch.zeros(1, 2, 3), (s, s))"
    )
    result = run_command([sys.executable, "-c", code], timeout=120, env=stand_in_env(TBH_EMULATE_CUDNN_RNN="1"))
    assert "rnn: hx is not contiguous" in result.stderr


def test_the_failing_model_fails_only_when_asked(monkeypatch):
    monkeypatch.syspath_prepend(str(STAND_INS))
    monkeypatch.setenv("TBH_FAIL_IN", "inference")
    monkeypatch.setenv("TBH_FAIL_AFTER", "1")
    from failing_models import FailingBody

    body = FailingBody((4,))
    frames = torch.from_numpy(np.zeros((2, 4), np.float32))
    with torch.no_grad():
        body(frames)
        with pytest.raises(ValueError, match="a bug in the model"):
            body(frames)
    body(frames)  # with grad: not an inference call
    sys.modules.pop("failing_models", None)


def test_gil_switch_interval_is_set_and_the_one_it_replaced_returned():
    python_default = sys.getswitchinterval()
    try:
        assert devices.set_gil_switch_interval(None) == python_default  # null: left as it is
        assert sys.getswitchinterval() == python_default
        assert devices.set_gil_switch_interval(0.5) == python_default
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert devices.set_gil_switch_interval(2) == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(python_default)
