"""benchmarks/throughput.py: its modes parse as docs/performance.md writes them, its figures add up, and the
pipeline mode (no env, no model) runs end to end."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pytest

from torchbeast_hydra.backends.mono.settings import auto_actors as mono_auto_actors
from torchbeast_hydra.logs.metrics import read_rows
from torchbeast_hydra.run import thread_trial
from torchbeast_hydra.run.devices import usable_cores

from helpers import BENCHMARKS, import_benchmark, run_command, write_run


@pytest.fixture
def throughput(monkeypatch):
    return import_benchmark(monkeypatch, "throughput")


def test_train_is_the_default_mode(throughput):
    args = throughput.parse_args(["backend=poly"])
    assert (args.mode, args.overrides, args.seconds, args.warmup, args.backends) == (
        "train",
        ["backend=poly"],
        90.0,
        60.0,
        None,
    )
    # The warm-up outlasts the learner's thread trial: its two windows and the updates between them.
    assert args.warmup >= 2 * thread_trial.WINDOW_S + 15
    assert throughput.parse_args([]).mode == "train"
    assert throughput.parse_args(["--seconds", "120"]).seconds == 120.0


def test_hydra_overrides_may_follow_a_list_option(throughput):
    args = throughput.parse_args(["pipeline", "--learner", "cli", "--envs", "4", "64", "experiment=cartpole"])
    assert (args.mode, args.envs, args.learner, args.overrides) == ("pipeline", [4, 64], "cli", ["experiment=cartpole"])
    args = throughput.parse_args(["train", "--backends", "mono", "poly", "backend.num_actors=16", "--warmup", "30"])
    assert (args.backends, args.warmup, args.overrides) == (["mono", "poly"], 30.0, ["backend.num_actors=16"])
    args = throughput.parse_args(["scaling", "--actors", "4", "8", "--backend", "mono"])
    assert (args.clients, args.backend, args.seconds, args.warmup) == ([4, 8], "mono", 40.0, 60.0)


def test_shared_memory_pipelines_are_the_null_learners_own(throughput, capsys):
    args = throughput.parse_args(["pipeline", "--transport", "grpc", "shared_memory", "--frames", "whole"])
    assert (args.transport, args.frames) == (["grpc", "shared_memory"], ["whole"])
    for refused in (["--learner", "cli"], ["--shards", "1", "2"]):
        with pytest.raises(SystemExit) as exited:
            throughput.parse_args(["pipeline", "--transport", "shared_memory", *refused])
        assert exited.value.code == 2 and "--learner none --shards 1" in capsys.readouterr().err


@pytest.mark.parametrize("mode, option", [("train", "--backends"), ("scaling", "--actors"), ("pipeline", "--learner")])
def test_each_mode_has_help(throughput, capsys, mode, option):
    with pytest.raises(SystemExit) as exited:
        throughput.parse_args([mode, "--help"])
    assert exited.value.code == 0
    page = capsys.readouterr().out
    assert f" {mode} [-h]" in page and option in page


def test_breakdown_divides_each_part_by_the_steps_it_served(throughput):
    # an update every 640 steps; central inference over 8 envs a pass
    rows = [
        dict(step=640 * i, update_ms="64", gather_ms="6.4", inference_ms="0.8", inference_batch_size="8")
        for i in range(1, 4)
    ]
    rows[0]["server_us_per_step"] = "30"
    assert throughput.breakdown(rows, env_us_alone=500.0) == pytest.approx(
        {
            "env (alone, one core)": 500.0,
            "central inference (mean batch 8.0)": 100.0,
            "wire + assembly (server threads, CPU)": 30.0,
            "batch gathering (learner)": 10.0,
            "learner update": 100.0,
        }
    )


def test_breakdown_takes_monos_own_env_and_inference_costs(throughput):
    rows = [
        dict(step=640 * i, update_ms="64", actor_env_us_per_step="120", actor_inference_us_per_step="") for i in (1, 2)
    ]
    rows[1]["actor_inference_us_per_step"] = "250"  # a blank: nothing measured in that row
    assert throughput.breakdown(rows, env_us_alone=500.0) == pytest.approx(
        {"env (in the actors)": 120.0, "inference (in the actors)": 250.0, "learner update": 100.0}
    )


def test_stage_costs_time_each_stage_of_a_step_alone(throughput, monkeypatch):
    composed = import_benchmark(monkeypatch, "_common").composed

    cfg = composed(["env=cartpole", "batch_size=4", "unroll_length=8"])
    assert cfg.backend.envs_per_actor == mono_auto_actors(usable_cores())[1]  # auto-sized, as the run sizes it
    assert composed(["env=cartpole", "backend.envs_per_actor=3"]).backend.envs_per_actor == 3
    costs = import_benchmark(monkeypatch, "_stages").stage_costs(cfg, inference_batch=4, envs_per_message=4)
    learner = ["learner: forward", "learner: losses", "learner: backward", "learner: optimiser"]
    assert list(costs) == [
        "env: the gymnasium env",
        "env: our lockstep wrapper (Environments)",
        "actor inference (batch 4)",
        *learner,
        "weight publication",
        "logging a row (csv, TensorBoard)",
    ]
    assert all(costs[stage] > 0 for stage in ["env: the gymnasium env", "actor inference (batch 4)", *learner])
    poly = import_benchmark(monkeypatch, "_stages").stage_costs(
        composed(["env=cartpole", "backend=poly", "batch_size=4", "unroll_length=8"]), 4, envs_per_message=4
    )
    assert poly["wire: encode a step (4 envs, client)"] > 0 and poly["wire: parse + decode + check (server)"] > 0


def test_cpu_is_counted_per_process_role_over_the_window(throughput, monkeypatch):
    common = import_benchmark(monkeypatch, "_common")
    learner, actors = "learner process", "actors"
    before = {1: (learner, 10.0), 2: (actors, 5.0), 3: (actors, 5.0)}
    after = {1: (learner, 13.0), 2: (actors, 6.0), 4: (actors, 0.5)}  # actor 3 died, 4 replaced it
    assert common.cpu_by_role(before, after) == pytest.approx({learner: 3.0, actors: 1.5})
    role, seconds = common.cpu_by_process(os.getpid())[os.getpid()]  # the root is the learner's
    assert role.startswith("learner process") and seconds > 0
    # 1,000 steps/s over 2 s on 2 cores: 2,000 core-us a step, of which the processes took 750
    run = throughput.Run(0, 2.0, 0, "", 2000, [], 1000.0, cpu={learner: 1.0, actors: 0.5}, window_s=2.0)
    assert throughput.by_process(run, cores=2) == pytest.approx(
        {actors: 250.0, learner: 500.0, "idle (no process of the run on a core)": 1250.0}
    )


def test_the_pipelines_trivial_policy_is_a_model_the_learner_can_run(monkeypatch):
    """benchmarks/conf/model/trivial_frames.yaml: the real learner's policy in `pipeline --learner cli`."""
    import torch
    import yaml

    from torchbeast_hydra.agent.models import make_model
    from torchbeast_hydra.env.spaces import EnvSpec

    import_benchmark(monkeypatch, "_probe_models")
    cfg = yaml.safe_load((BENCHMARKS / "conf" / "model" / "trivial_frames.yaml").read_text())
    model = make_model(cfg, EnvSpec.box((4, 84, 84), "uint8", 6))
    frames = torch.randint(0, 255, (3, 2, 4, 84, 84), dtype=torch.uint8)
    inputs = dict(frame=frames, reward=torch.zeros(3, 2), done=torch.zeros(3, 2, dtype=torch.bool))
    inputs["last_action"] = torch.zeros(3, 2, dtype=torch.int64)
    outputs, _ = model(inputs, model.initial_state(2))
    assert outputs["policy_logits"].shape == (3, 2, 6) and outputs["baseline"].shape == (3, 2)
    assert model.body.output_size == cfg["width"] and model.body.fc.in_features == 4 * 4 * 4  # a 4x4 grid a channel


def test_random_actions_fit_each_kind_of_action_space(monkeypatch):
    import gymnasium as gym
    import numpy as np

    from torchbeast_hydra.env.actions import action_spec

    spaces = [
        gym.spaces.Discrete(5),
        gym.spaces.MultiDiscrete([3, 4]),
        gym.spaces.MultiBinary(3),
        gym.spaces.Box(-2.0, 1.0, (2,), np.float32),
    ]
    for space in spaces:
        spec = action_spec(space, "Test-v0")
        actions = import_benchmark(monkeypatch, "_stages").random_actions(spec, 200)
        assert actions.shape == (200, *spec.step_shape), space
        if spec.kind == "box":
            assert actions.min() >= -2.0 and actions.max() <= 1.0
        else:  # the policy's side: choice indices from 0
            assert actions.min() == 0 and (actions < np.asarray(spec.nvec or (2,) * spec.size)).all()


def test_train_mode_with_steps_runs_a_whole_run_to_its_end(throughput, monkeypatch):
    asked = []

    def train(run_dir, overrides, seconds=None, warmup=0.0):
        asked.append((overrides[-1], seconds))
        return import_benchmark(monkeypatch, "_common").Trained(0, 10.0, 0)

    monkeypatch.setattr(throughput, "train", train)
    assert throughput.parse_args(["--steps", "150000"]).steps == 150000
    throughput.measure(["backend=poly"], warmup=20, seconds=30, steps=150000)
    throughput.measure(["backend=poly"], warmup=20, seconds=30)
    assert asked == [("total_steps=150000", None), ("backend=poly", 50)]  # to its end; else stopped after 50 s


def test_overrides_replace_the_benchmarks_defaults_of_the_same_key(throughput):
    overrides = throughput.with_defaults(["env=nethack", "batch_size=32", "backend=poly"])
    assert "env=pong" not in overrides and "batch_size=8" not in overrides
    assert overrides[-3:] == ["env=nethack", "batch_size=32", "backend=poly"] and "unroll_length=80" in overrides


def test_scaling_shows_a_dash_for_what_the_backend_does_not_log(throughput, monkeypatch, capsys):
    rows = [dict(step=640 * i, time_s=float(i), learner_queue_size="3") for i in range(3)]  # no inference columns
    run = throughput.Run(0, 60.0, 0, "no GPU", 1280, rows, 640.0, cpu={}, window_s=0.0)
    asked = []
    monkeypatch.setattr(throughput, "measure", lambda overrides, warmup, seconds: asked.append(overrides) or run)
    monkeypatch.setattr(throughput, "platform_line", lambda: "test machine")
    throughput.scaling_mode(throughput.parse_args(["scaling", "--backend", "mono", "--actors", "4", "8", "env.id=X"]))
    assert asked == [["backend=mono", f"backend.num_actors={n}", "env.id=X"] for n in (4, 8)]
    table = capsys.readouterr().out.splitlines()[2:]
    assert table[0].split() == ["actors", "steps/s", "inference", "batch", "inference", "ms", "learner", "queue"]
    assert [line.split() for line in table[1:]] == [["4", "640", "-", "-", "3.0"], ["8", "640", "-", "-", "3.0"]]


@pytest.mark.slow
def test_pipeline_mode_runs(tmp_path):
    pipeline = [
        "pipeline",
        "--clients",
        "1",
        "--envs",
        "4",
        "--frames",
        "whole",
        "newest",
        "--transport",
        "grpc",
        "shared_memory",
        "--batch-size",  # a batch every 40 env-steps: a loaded machine still makes some in 2 s
        "4",
        "--unroll-length",
        "10",
        "--warmup",
        "1",
        "--seconds",
        "2",
    ]
    result = run_command([sys.executable, BENCHMARKS / "throughput.py", *pipeline], timeout=240)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[-3:]]
    assert [row[:4] for row in rows] == [
        ["1", "whole", "1", "4"],
        ["1", "newest", "1", "4"],
        ["1", "shm", "1", "4"],
    ]  # shards, path (gRPC's frame encoding, or shared memory), clients, envs
    assert all(float(row[4].replace(",", "")) > 0 for row in rows)  # env-steps/s
    assert all(float(row[9]) > 0 for row in rows)  # the server's CPU an env-step, on either path


def test_train_mode_counts_training_time_by_the_runs_own_clock(monkeypatch, tmp_path):
    """The measured window is training time (logs.csv's time_s), not time since the process started:
    a run still starting up has logged no training time, however long it has been starting."""
    common = import_benchmark(monkeypatch, "_common")
    assert common._trained_for(tmp_path / "not yet") is None
    write_run(tmp_path / "run", [], 1, [(640, [1.0], 0.5), (1280, [2.0], 0.4)], steps_per_s=64)
    assert common._trained_for(tmp_path / "run") == 20.0


def test_the_pipelines_envs_end_episodes_out_of_step_when_asked(monkeypatch):
    pipeline = import_benchmark(monkeypatch, "_pipeline")
    actions = np.zeros(4, np.int64)
    never = pipeline.FixedFrames((4,), "float32", 2)(4, seed=0)
    assert not any(never.step(actions)["done"].any() for _ in range(100))
    envs = pipeline.FixedFrames((4,), "float32", 2, episode_steps=10)(4, seed=0)
    ends = np.array([envs.step(actions)["done"].copy() for _ in range(200)])
    assert (ends.sum(axis=0) >= 200 // 15).all() and (ends.sum(axis=0) <= 200 // 5).all()  # lengths 5 to 15
    firsts = {int(np.flatnonzero(ends[:, env])[0]) for env in range(4)}
    assert len(firsts) > 1, "the envs' episodes end at steps of their own"
    out = envs.step(actions)
    assert (out["episode_end"] == out["done"]).all()  # a whole game ends: no truncation here


def test_the_pbt_benchmarks_signed_rank_test_is_exact(monkeypatch):
    pbt = import_benchmark(monkeypatch, "pbt")
    # All of 8 differences ahead: only 2 of the 2^8 sign patterns are as far from the centre.
    assert pbt.signed_rank_test([1.0, 2, 3, 4, 5, 6, 7, 8]) == (2 / 256, 8)
    assert pbt.signed_rank_test([0.0, 0.0, 5.0]) == (1.0, 1)  # zeros dropped; one difference proves nothing
    assert pbt.signed_rank_test([-2.0, 2.0])[0] == 1.0  # tied sizes, opposite signs: no evidence either way
    # The first 8 seeds' differences: 6 ahead, 1 behind (the smallest but one), 1 tied -> p = 20/128.
    p, used = pbt.signed_rank_test([7.6, 0.0, 16.2, 418.8, 7.9, -11.4, 9.3, 5.4])
    assert used == 7 and p == 20 / 128
    assert list(pbt.average_ranks(np.array([3.0, 1.0, 3.0, 2.0]))) == [3.5, 1.0, 3.5, 2.0]


def test_the_pbt_benchmarks_hodges_lehmann_interval(monkeypatch):
    pbt = import_benchmark(monkeypatch, "pbt")
    # 3 differences cannot reach 95% (the likeliest tail is 1/8): the whole range of the Walsh averages.
    assert pbt.hodges_lehmann([1.0, 2.0, 3.0]) == (2.0, 1.0, 3.0)
    # n = 8: P(sum of positive ranks <= 3) = 5/256 <= 2.5% < P(<= 4): the 4th smallest and largest of 36.
    d = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]
    walsh = sorted((a + b) / 2 for i, a in enumerate(d) for b in d[i:])
    estimate, low, high = pbt.hodges_lehmann(d)
    assert (low, high) == (walsh[3], walsh[-4]) and low < estimate < high


def test_the_pbt_benchmark_compares_the_measure_asked_for(monkeypatch, capsys):
    """--measure greedy compares the picks' greedy play, --measure train the arms' best members by
    their final training mean; a seed not played in both arms is left out of either."""
    pbt = import_benchmark(monkeypatch, "pbt")
    figures = {  # (seed, arm) -> greedy, best training mean
        (1, "pbt"): (10.0, 100.0), (1, "fixed"): (30.0, 40.0),
        (2, "pbt"): (-5.0, 90.0), (2, "fixed"): (15.0, 50.0),
        (3, "pbt"): (0.0, 0.0),
    }  # fmt: skip

    def arm_result(greedy, train):
        return dict(greedy=greedy, train=train, mean=train / 2, member=0, score=train, exploits=0)

    results = {seed: {arm: None for arm in pbt.ARMS} for seed in (1, 2, 3)}
    for (seed, arm), (greedy, train) in figures.items():
        results[seed][arm] = arm_result(greedy, train)
    for measure, difference in (("greedy", "-20.0"), ("train", "50.0")):
        pbt.summarise(results, argparse.Namespace(measure=measure))
        out = capsys.readouterr().out
        assert "2 seed(s) finished in both arms" in out and "seed 3:  pbt: picked" in out
        assert f"pbt - fixed: {difference} " in out, out


def test_the_pbt_benchmark_keeps_what_a_report_reads(monkeypatch, tmp_path):
    """thin(): a played arm keeps its logs' report columns (gzipped), eval.csv and the lineage, and
    loses checkpoints, text logs and submitit's files; the kept logs read back row for row."""
    pbt = import_benchmark(monkeypatch, "pbt")
    sweep, test = tmp_path / "pbt" / "seed1", tmp_path / "test" / "pbt" / "seed1"
    member = sweep / "pbt.member=0"
    write_run(member, [], 1, [(640, [1.0], 0.5), (1280, [2.0, 3.0], 0.4)], choices={}, steps_per_s=64)
    for path in (member / "checkpoint.pt", member / "torchbeast.log", sweep / "pbt" / "pbt.csv",
                 sweep / "pbt" / "checkpoint_member0.pt", sweep / ".submitit" / "job.pkl", test / "torchbeast.log",
                 test / "eval.csv"):  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    before = read_rows(member)
    pbt.thin(sweep, test)
    kept = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert kept == [
        "pbt/seed1/pbt.member=0/.hydra/config.yaml",
        "pbt/seed1/pbt.member=0/.hydra/hydra.yaml",
        "pbt/seed1/pbt.member=0/.hydra/overrides.yaml",
        "pbt/seed1/pbt.member=0/logs.csv.gz",
        "pbt/seed1/pbt/pbt.csv",
        "test/pbt/seed1/eval.csv",
    ]
    after = read_rows(member)
    assert [(r["step"], r["episode_returns"]) for r in after] == [(r["step"], r["episode_returns"]) for r in before]


def test_gil_switch_sketch_prints_a_row_per_interval_and_leaves_pythons(monkeypatch, capsys):
    gil_switch = import_benchmark(monkeypatch, "gil_switch")
    python_default = sys.getswitchinterval()
    monkeypatch.setattr(sys, "argv", ["gil_switch.py", "--intervals-ms", "5", "0.5", "--seconds", "0.2"])
    gil_switch.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[:2] for row in rows] == [["5", "ms"], ["0.5", "ms"]]
    assert all(float(row[2]) > 0 and float(row[4]) > 0 for row in rows)
    assert sys.getswitchinterval() == python_default
