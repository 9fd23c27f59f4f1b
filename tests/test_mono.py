"""End-to-end runs of the mono backend through the CLI, on tiny CartPole and Pong configs (and the
resumes a run refuses, in process)."""

import os
import re
import shutil
import signal

import pytest
import torch
import yaml

from torchbeast_hydra.backends.mono import backend as mono_backend
from torchbeast_hydra.run import checkpoint

from helpers import REPO, TINY, actor_pids, cli_env, resume_refusal, rows, run_cli, running, start_cli, steps, wait_for

pytestmark = pytest.mark.slow  # end-to-end runs; `make test-fast` leaves them out


def test_tiny_run_writes_logs_checkpoint_and_provenance(tiny_run):
    # One row per update of B*T = 64 steps, ending exactly at total_steps even with two learner
    # threads racing for the last batch.
    assert steps(tiny_run) == list(range(64, 2560 + 1, 64))
    last = rows(tiny_run)[-1]
    for field in (
        "sps",
        "total_loss",
        "pg_loss",
        "baseline_loss",
        "entropy_loss",
        "learning_rate",
        "free_queue_size",
        "full_queue_size",
        "episodes",
    ):
        assert last[field] is not None, field
    # The actors' timings go to the row of the batch fetched after their reports came: with two
    # learner threads a row may find none new (blank: nothing measured since the last row).
    for field in ("actor_env_us_per_step", "actor_inference_us_per_step"):
        assert sum(row[field] is not None for row in rows(tiny_run)) >= len(rows(tiny_run)) // 2, field
    assert int(last["episodes"]) > 0 and float(last["sps"]) > 0
    state = checkpoint.load(checkpoint.path_in(tiny_run))
    assert state["step"] == steps(tiny_run)[-1]
    assert state["config"]["env"]["id"] == "CartPole-v1"
    info = yaml.safe_load((tiny_run / "run_info.yaml").read_text())
    assert "git_commit" in info and "torch" in info
    # The start-up summary: in the log as one block, and in run_info.yaml.
    startup = info["startup"]
    assert startup["device"].startswith("cpu (") and startup["batch"] == "4 unrolls x 16 steps"
    assert startup["acting"].startswith("2 actor processes x 2 envs = 4 envs")
    assert re.fullmatch(r"1 torch thread|\d+ torch threads", startup["learner"])  # an MLP: float32 on any CPU
    assert startup["model"].startswith("MLPBody, ") and startup["model"].endswith(" parameters")
    assert startup["run dir"] == str(tiny_run.resolve()) and startup["wandb"] == "disabled"
    log = (tiny_run / "torchbeast.log").read_text()
    assert "Starting:\n  device   cpu (" in log
    assert "Finished: 2,560 agent steps (total_steps=2,560)" in log
    assert not any("PATH" in str(v) for v in info.values())  # never the process environment
    assert (tiny_run / ".hydra" / "config.yaml").exists()
    assert (tiny_run / "torchbeast.log").read_text().count("Saved checkpoint") >= 1


@pytest.fixture(scope="module")
def resumed_run(tiny_run, tmp_path_factory):
    """tiny_run resumed to 3840 steps with a changed entropy cost, from a checkpoint written by older
    code: its saved config lacks fields added since, and it records no env spaces. Tests only read it."""
    run_dir = shutil.copytree(tiny_run, tmp_path_factory.mktemp("resumed") / "run")
    path = checkpoint.path_in(run_dir)
    state = checkpoint.load(path)
    for group, key in (("model", "lstm_layers"), ("env", "imports"), ("vtrace", "extra_losses")):
        del state["config"][group][key]
    del state["env"]  # older checkpoints did not record the env's spaces either
    checkpoint.save(path, state)
    run_cli(run_dir, *TINY, "total_steps=3840", "vtrace.entropy_cost=0.02")
    return run_dir


def test_resume_continues_steps_optimizer_and_schedule(tiny_run, resumed_run):
    first = checkpoint.load(checkpoint.path_in(tiny_run))  # where the resumed run started
    assert "Resuming from" in (resumed_run / "torchbeast.log").read_text()
    logged = steps(resumed_run)
    assert logged == sorted(set(logged)), "no duplicate or out-of-order rows"
    assert logged[-1] == 3840
    diffs = {b - a for a, b in zip(logged, logged[1:])}
    assert diffs == {64}, "no missing rows across the restart"
    times = [float(row["time_s"]) for row in rows(resumed_run)]
    assert times == sorted(times), "the training clock goes on across the restart"
    second = checkpoint.load(checkpoint.path_in(resumed_run))
    updates = second["learner"]["scheduler"]["last_epoch"]
    assert updates == first["learner"]["scheduler"]["last_epoch"] + (logged[-1] - first["step"]) // 64
    opt_steps = [s["step"] for s in second["learner"]["optimizer"]["state"].values()]
    assert all(float(s) == updates for s in opt_steps), "optimizer state carried over"


def test_resume_survives_config_fields_added_since(resumed_run):
    """A checkpoint from older code, whose saved config lacks fields added since, still resumes."""
    log = (resumed_run / "torchbeast.log").read_text()
    assert "Resuming from" in log
    assert steps(resumed_run)[-1] == 3840
    # Each changed setting is said, one line per key, and applied; fields added since are not changes.
    assert "Resuming with 2 changed setting(s)" in log
    assert "  total_steps: 2560 -> 3840" in log and "  vtrace.entropy_cost: 0.01 -> 0.02" in log
    assert "lstm_layers" not in log and "extra_losses" not in log
    info = yaml.safe_load((resumed_run / "run_info.yaml").read_text())
    assert info["startup"]["resumed"] == "at step 2,560, 2 settings changed"
    saved = yaml.safe_load((resumed_run / ".hydra" / "config.yaml").read_text())
    assert saved["vtrace"]["entropy_cost"] == 0.02, "the run dir's config says what the run now uses"
    assert checkpoint.load(checkpoint.path_in(resumed_run))["config"]["vtrace"]["entropy_cost"] == 0.02


def refused_resume(run_dir, *overrides: str) -> str:
    """The refusal of a resume of tiny_run's copy with TINY and these overrides (in process)."""
    refusal = resume_refusal(run_dir, *TINY, *overrides)
    assert steps(run_dir)[-1] == 2560  # nothing written
    return refusal


def test_resume_with_a_different_model_is_refused(tiny_run_copy):
    assert "trained with model=" in refused_resume(tiny_run_copy, "model.hidden_sizes=[32]")
    assert checkpoint.load(checkpoint.path_in(tiny_run_copy))["step"] >= 2560  # untouched


def test_corrupt_checkpoint_stops_with_a_clear_error_and_is_kept(tiny_run_copy):
    path = checkpoint.path_in(tiny_run_copy)
    path.write_bytes(b"not a checkpoint")
    before = steps(tiny_run_copy)
    result = run_cli(tiny_run_copy, *TINY, "total_steps=5120", check=False)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "corrupt" in output and str(path) in output
    assert path.read_bytes() == b"not a checkpoint"
    assert steps(tiny_run_copy) == before


def test_unknown_env_id_fails_before_anything_starts(tmp_path):
    result = run_cli(tmp_path / "run", *TINY, "env.id=CartPoel-v1", check=False)
    assert result.returncode == 2
    assert "Did you mean CartPole-v1" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "logs.csv").exists()


def test_model_that_does_not_fit_the_env_fails_clearly(tmp_path):
    result = run_cli(tmp_path / "run", "env=cartpole", "model=atari_net", check=False)
    assert result.returncode == 2
    assert "Use model=mlp" in result.stdout + result.stderr


# tests/overflow_envs.py: float64 observations with a 1e300 at every episode's 5th step.
OVERFLOWING = [
    *TINY,
    "backend.num_actors=1",
    "env.id=Overflowing-v0",
    "env.imports=[overflow_envs]",
    "model.normalize_obs=true",
]
WITH_TEST_ENVS = cli_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))


def test_an_observation_beyond_the_models_range_stops_the_run_naming_env_leaf_and_value(tmp_path):
    result = run_cli(tmp_path / "run", *OVERFLOWING, env=WITH_TEST_ENVS, check=False)
    assert result.returncode == 1
    error = [line for line in (result.stdout + result.stderr).splitlines() if "error: " in line][-1]
    assert "the run stopped on BadObservation: actor " in error
    assert "(Overflowing-v0) returned an observation the model cannot take: frame holds 1e+300, beyond +-3.403e+38" in (
        error
    )
    assert "learning_rate" not in error


def test_clipping_observations_to_the_models_range_trains_on_and_counts_the_clips(tmp_path):
    run_dir = tmp_path / "run"
    run_cli(run_dir, *OVERFLOWING, "backend.clip_obs_to_model_range=true", env=WITH_TEST_ENVS)
    logged = rows(run_dir)
    assert steps(run_dir)[-1] >= 2560 and all(float(row["total_loss"]) == float(row["total_loss"]) for row in logged)
    assert sum(int(row["clipped_obs"]) for row in logged) > 0


class FreshArrays:
    """Envs that hand back new arrays at each step, as the native vector env does with its frames:
    the observation is the step's number."""

    def __init__(self, spec, num_envs: int):
        self.spec, self.num_envs, self.t = spec, num_envs, 0

    def __len__(self) -> int:
        return self.num_envs

    def initial(self) -> dict:
        return self._outputs()

    def step(self, actions) -> dict:
        self.t += 1
        return self._outputs()

    def _outputs(self) -> dict:
        from torchbeast_hydra.env.layout import env_outputs

        out = env_outputs(self.spec, self.num_envs)
        out["frame"][:] = self.t
        return out


class Grants:
    """The learner's end of an actor's pipe: grants these buffers once, then says stop."""

    def __init__(self, buffers: list):
        self.messages = [mono_backend._encode(buffers), b""]
        self.sent = []

    def recv_bytes(self) -> bytes:
        return self.messages.pop(0)

    def send_bytes(self, message: bytes) -> None:
        self.sent.append(message)


def test_actors_write_each_steps_observation_even_when_the_envs_hand_back_new_arrays():
    """The native vector env returns a new frame array each step; an actor that kept views of the
    first step's arrays wrote that frame into every row (Pong did not learn)."""
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import EnvSpec

    spec = EnvSpec.box((4,), "uint8", 3)
    model = make_model({"_target_": "torchbeast_hydra.agent.models.MLPBody", "hidden_sizes": [8]}, spec)
    T, count = 5, 4
    buffers, states = mono_backend.create_buffers(spec, T, count), mono_backend.create_state_buffers(model, count)
    envs = FreshArrays(spec, num_envs=2)
    guard = mono_backend.ObservationGuard(spec, "FreshArrays", limit=3e38, clip=False)
    pipe = Grants([1, 3])
    mono_backend._act(envs, guard, T, model, torch.zeros((), dtype=torch.int64), buffers, states, pipe)
    assert pipe.sent and pipe.sent[0].startswith(mono_backend.REPORT)
    for t in range(T + 1):
        assert (buffers["frame"][t, [1, 3]] == t).all(), t
    assert (buffers["frame"][:, [0, 2]] == 0).all()  # buffers not granted are left alone


def test_actors_acting_in_bf16_write_fp32_logits_and_see_each_new_weight():
    """Autocast keeps bf16 copies of the weights until its context ends: an actor that held one
    context around its whole loop would act with the first weights it saw for the rest of the run."""
    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import EnvSpec

    spec = EnvSpec.box((4,), "uint8", 3)
    torch.manual_seed(0)
    model = make_model({"_target_": "torchbeast_hydra.agent.models.MLPBody", "hidden_sizes": [8]}, spec)
    T, count = 3, 4
    buffers, states = mono_backend.create_buffers(spec, T, count), mono_backend.create_state_buffers(model, count)
    guard = mono_backend.ObservationGuard(spec, "FreshArrays", limit=3e38, clip=False)
    pipe = Grants([0, 1])
    pipe.messages.insert(1, mono_backend._encode([2, 3]))
    grant = pipe.recv_bytes

    def new_weights_before_the_second_grant() -> bytes:
        if len(pipe.messages) == 2:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.zero_()
        return grant()

    pipe.recv_bytes = new_weights_before_the_second_grant
    version = torch.zeros((), dtype=torch.int64)
    mono_backend._act(FreshArrays(spec, num_envs=2), guard, T, model, version, buffers, states, pipe, bf16=True)
    logits = buffers["policy_logits"]
    assert logits.dtype == torch.float32 and len(pipe.sent) == 2
    assert (logits[1:, [0, 1]] != 0).any()  # the first unroll, with the first weights
    assert (logits[1:, [2, 3]] == 0).all()  # the second, with the zeroed ones


@pytest.mark.parametrize("vector_env", [True, False], ids=["native-vector-env", "gymnasium-envs"])
def test_pong_run_with_atari_net(tmp_path, vector_env):
    run_dir = tmp_path / "run"
    run_cli(
        run_dir,
        "env=pong",
        "total_steps=640",
        "unroll_length=20",
        "batch_size=4",
        "backend.num_actors=1",
        "backend.envs_per_actor=2",
        f"backend.vector_env={str(vector_env).lower()}",
    )
    logged = rows(run_dir)
    assert int(logged[-1]["step"]) >= 640
    assert float(logged[-1]["learning_rate"]) < 0.00048  # annealing


def test_killed_actor_is_replaced_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    # No evaluation process (started beside the actors when evaluations are due): the spawned children are the actors.
    process = start_cli(run_dir, *TINY, "total_steps=60000", "eval.interval_steps=0")
    try:
        victims = wait_for(lambda: len(actor_pids(process.pid)) == 2 and actor_pids(process.pid), 60, "two actors")
        wait_for(lambda: (run_dir / "logs.csv").exists() and len(rows(run_dir)) > 2, 60, "training")
        os.kill(victims[0], signal.SIGKILL)
        output, _ = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 0, output
    # Named by its pid: with pids wrapping at 32768, the first actor started need not have the smaller one.
    assert f"(pid {victims[0]}) died with exit code -9" in output
    assert steps(run_dir)[-1] >= 60000


def test_sigterm_stops_cleanly_with_a_checkpoint_and_no_orphans(tmp_path):
    run_dir = tmp_path / "run"
    process = start_cli(run_dir, *TINY, "total_steps=10000000")
    try:
        wait_for(lambda: (run_dir / "logs.csv").exists() and len(rows(run_dir)) > 2, 60, "training")
        actors = actor_pids(process.pid)
        assert actors
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, output
    state = checkpoint.load(checkpoint.path_in(run_dir))
    assert state["step"] == steps(run_dir)[-1]
    last = output.strip().splitlines()[-1]
    assert "Stopped by SIGTERM at step" in last and "ETA" not in last
    assert "Resume with: python -m torchbeast_hydra experiment=cartpole " in last
    assert last.endswith(f" hydra.run.dir={run_dir}")
    for pid in actors:
        assert not running(pid)


def test_test_mode_without_checkpoint_fails_clearly(tmp_path):
    result = run_cli(tmp_path / "eval", "experiment=cartpole", "mode=test", f"load_dir={tmp_path}", check=False)
    assert result.returncode == 2
    assert "no checkpoint" in result.stdout + result.stderr


def test_gather_copies_the_chosen_buffers_in_time_major_order():
    from torchbeast_hydra.backends.mono.backend import gather

    buffers = torch.arange(3 * 5 * 2).view(3, 5, 2)
    batch = gather(buffers, torch.tensor([4, 1]), pin=False)
    assert torch.equal(batch, buffers[:, [4, 1]])
    batch[0, 0, 0] = -1  # a copy: the shared buffer is free to be refilled
    assert buffers[0, 4, 0] == 8


def test_resume_with_another_optimiser_is_refused(tiny_run_copy):
    refusal = refused_resume(tiny_run_copy, "optim=rmsprop")
    assert "optim.name" in refusal and "cannot carry over" in refusal


def test_resume_in_another_env_with_the_same_spaces_is_refused(tiny_run_copy):
    assert "trained with env=" in refused_resume(tiny_run_copy, "env.id=CartPole-v0")


def test_normalized_values_train_resume_and_play(tmp_path):
    """model.normalize_values (PopArt): its statistics are the model's, so a run resumes with them and
    test mode plays the checkpoint."""
    run_dir, popart = tmp_path / "run", [*TINY, "model.normalize_values=true"]
    run_cli(run_dir, *popart)
    first = checkpoint.load(checkpoint.path_in(run_dir))["learner"]["model"]
    assert first["value_norm.updates"].item() == 2560 // 64  # one per update (one pass, one minibatch)
    run_cli(run_dir, *popart, "total_steps=3840")
    resumed = checkpoint.load(checkpoint.path_in(run_dir))["learner"]["model"]
    assert resumed["value_norm.updates"].item() == 3840 // 64  # went on from the checkpoint's
    played = run_cli(tmp_path / "eval", *popart, "mode=test", f"load_dir={run_dir}", "test.num_episodes=2")
    assert "Mean return over 2 episodes" in played.stdout + played.stderr
