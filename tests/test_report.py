"""The report command: per-task curves and tables, normalised aggregates, from runs written as training writes them."""

import csv
import dataclasses
import gzip
import json
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from matplotlib.figure import Figure

from torchbeast_hydra.analysis import baselines, figures, measures, report, runs, scores, tables
from torchbeast_hydra.evaluation.evaluate import EVAL_FIGURES
from torchbeast_hydra.logs import metrics
from torchbeast_hydra.logs.sweep_record import is_run_control

from helpers import REPO, assert_real_image, run_command, write_run

# Per task and seed: (env option, env.id, evaluation returns at steps 1,000, 2,000 and 3,000).
# Finals normalise to 1.0 and 0.5 (Pong: random -20.7, human 14.6) and to 0.0 and 1.0
# (HalfCheetah: random -280.178953, CleanRL PPO 1442.64).
EVALS = {
    ("pong", "ALE/Pong-v5", 1): [-20.0, 0.0, 14.6],
    ("pong", "ALE/Pong-v5", 2): [-21.0, -3.05, -3.05],
    ("mujoco", "HalfCheetah-v5", 1): [-300.0, -200.0, -280.178953],
    ("mujoco", "HalfCheetah-v5", 2): [0.0, 1500.0, 1442.64],
}
STEPS = [1000, 2000, 3000]


def write_job(job_dir, option, env_id, seed, evals=None, extra_overrides=(), config=None):
    """A sweep job as training leaves it (logs.csv with time_s, .hydra/), plus its eval.csv."""
    overrides = [f"env={option}", f"seed={seed}", *extra_overrides]
    config = dict(env=dict(id=env_id), **(config or {}))
    rows = [(step, [float(seed)], 0.5) for step in STEPS]
    write_run(job_dir, overrides, seed, rows, config=config, choices=dict(env=option), steps_per_s=100.0)
    if evals is not None:
        with open(job_dir / "eval.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, ["step", *EVAL_FIGURES, "greedy", "seed"])
            writer.writeheader()
            for step, value in zip(STEPS, evals):
                figures = dict(episodes=10, mean_return=value, std_return=1.0, min_return=value - 1)
                figures.update(max_return=value + 1, mean_length=100.0, seconds=2.0)
                writer.writerow(dict(step=step, **figures, greedy=True, seed=seed))


@pytest.fixture
def sweep(tmp_path):
    """2 tasks x 2 seeds; the seeds of a task also differ in logging and output keys only."""
    sweep = tmp_path / "multirun"
    for job, ((option, env_id, seed), evals) in enumerate(EVALS.items()):
        logging = [f"logger.tensorboard={seed == 1}", f"checkpoint_interval_s={60 * seed}"]
        config = dict(logger=dict(tensorboard=seed == 1, wandb=dict(mode="auto" if seed == 1 else "offline")))
        write_job(sweep / str(job), option, env_id, seed, evals, logging, config)
    (sweep / "multirun.yaml").write_text("{}\n")
    return sweep


def test_report_writes_curves_tables_and_aggregates_with_the_right_numbers(sweep, tmp_path):
    options = report.Options(targets={"ALE/Pong-v5": 0.0}, reps=2000)
    written = report.write_report([sweep], tmp_path / "out", options)

    for name in ("curve_ALE_Pong-v5.png", "curve_HalfCheetah-v5.png", "performance_profile.png"):
        assert_real_image(tmp_path / "out" / name)

    tasks = pd.read_csv(written["tasks_csv"]).set_index("task")
    pong, cheetah = tasks.loc["ALE/Pong-v5"], tasks.loc["HalfCheetah-v5"]
    # Logging and output keys make no setting: each task's two seeds are aggregated.
    assert pong["setting"] == cheetah["setting"] == runs.ALL_RUNS and pong["seeds"] == cheetah["seeds"] == 2
    assert pong["final"] == pytest.approx((14.6 - 3.05) / 2)
    # Two seeds: the bootstrap's replicates range from both at the lower to both at the higher.
    assert (pong["final_low"], pong["final_high"]) == (pytest.approx(-3.05), pytest.approx(14.6))
    assert pong["best"] == pytest.approx((14.6 - 3.05) / 2)
    assert cheetah["best"] == pytest.approx((-200.0 + 1500.0) / 2)
    assert (pong["reached"], pong["steps_to_target"]) == (1, 2000)  # seed 1 at 2,000; seed 2 never
    assert pong["wall_s"] == 30.0 and pong["sps"] == 100.0

    # Normalised finals: Pong 1.0, 0.5 (by human: an anchor, against our final score). CleanRL's
    # HalfCheetah figure is the last 100 training episodes at 1M steps: these 3,000-step runs are
    # short of it, so HalfCheetah is not compared (test_the_peers_measure_... compares it).
    (aggregate,) = pd.read_csv(written["aggregates_csv"]).to_dict("records")
    assert (aggregate["tasks"], aggregate["runs"]) == (1, 2)
    assert aggregate["IQM"] == aggregate["mean"] == pytest.approx(0.75)
    assert aggregate["optimality gap"] == pytest.approx(0.25)
    expected = scores.aggregate_intervals({"pong": [1.0, 0.5]}, reps=2000, seed=0)
    assert (aggregate["IQM_low"], aggregate["IQM_high"]) == pytest.approx(expected["IQM"][1:])

    text = written["report"].read_text()
    assert "Score: evaluation return" in text
    assert "![ALE/Pong-v5](curve_ALE_Pong-v5.png)" in text and "![performance profile](performance_profile.png)" in text
    assert "| steps to 0 |" in text and "2,000 (1/2 seeds); the others' best: -3.05" in text
    assert "| all runs | 1 | 2 | 0.750 [" in text
    assert "ALE/Pong-v5 by human (the final score)" in text
    assert "HalfCheetah-v5 (2 of 2 runs short of CleanRL PPO's budget, 1,000,000 steps: not comparable)" in text
    # Two seeds: their range, said to be one; the peers' measure beside our evaluation.
    assert "| all runs | 2 | 5.78 (range -3.05 to 14.6) |" in text
    assert "last 100 training episodes at 1,000,000 steps" in text
    # A reference, its measure, env, budget and source, and whether it compares.
    assert (
        "- Cleanba IMPALA: 19.1, measured otherwise (Cleanba's 57-game table: sticky actions 0.25 and the full "
        "action space, which episodes it averages not read here), on envpool Pong-v5, at 50,000,000 steps; "
        "shown, not compared" in text
    )
    assert "- human: 14.6, a human's score; an anchor" in text
    assert "logger." not in text and "checkpoint_interval_s" not in text


def test_settings_leave_out_the_seed_and_logging_keys_but_keep_what_was_swept(tmp_path):
    for job, (lr, seed) in enumerate([("0.001", 1), ("0.001", 2), ("0.002", 1)]):
        overrides = [f"optim.learning_rate={lr}", f"logger.wandb.mode={'auto' if seed == 1 else 'offline'}"]
        config = dict(optim=dict(learning_rate=float(lr)), logger=dict(wandb=dict(mode="auto" if seed == 1 else "x")))
        write_job(tmp_path / str(job), "pong", "ALE/Pong-v5", seed, None, overrides, config)
    loaded = runs.load([tmp_path])
    assert [r.setting for r in loaded] == ["optim.learning_rate=0.001"] * 2 + ["optim.learning_rate=0.002"]
    assert is_run_control("logger.wandb.mode") and is_run_control("hydra.run.dir") and not is_run_control("loggers")


def test_runs_without_evaluations_use_the_training_return_or_are_left_out(sweep, tmp_path):
    (sweep / "3" / "eval.csv").unlink()
    auto = report.write_report([sweep], tmp_path / "auto", report.Options(reps=200))
    assert "Score: training return (the mean of the last 100 episodes" in auto["report"].read_text()
    assert "Only 3 of 4 runs have an eval.csv, so none is used" in auto["report"].read_text()
    # Each training episode returned the seed: final and best are the seeds' mean.
    tasks = pd.read_csv(auto["tasks_csv"]).set_index("task")
    assert tasks.loc["ALE/Pong-v5", "final"] == 1.5 and tasks.loc["HalfCheetah-v5", "best"] == 1.5

    # Asked for, the training return is not explained away by missing evaluations.
    train = report.write_report([sweep], tmp_path / "train", report.Options(metric="train", reps=200))
    assert "have an eval.csv" not in train["report"].read_text()

    evals = report.write_report([sweep], tmp_path / "eval", report.Options(metric="eval", reps=200))
    assert "Left out, no evaluation yet: 3." in evals["report"].read_text()
    assert pd.read_csv(evals["tasks_csv"]).set_index("task").loc["HalfCheetah-v5", "seeds"] == 1


def test_a_job_just_started_is_named_not_drawn_and_a_short_run_stays_on_a_long_grid(sweep, tmp_path):
    # A sweep in progress: job 4 has written its csv headers and nothing else yet.
    write_job(sweep / "4", "pong", "ALE/Pong-v5", 3, evals=[])
    with open(sweep / "4" / "logs.csv") as f:
        header = f.readline()
    (sweep / "4" / "logs.csv").write_text(header)
    for metric in ("eval", "train"):
        text = report.write_report([sweep], tmp_path / metric, report.Options(metric=metric, reps=200))["report"]
        assert f"Left out, no {'evaluation' if metric == 'eval' else 'finished episode'} yet: 4." in text.read_text()
    # One run with 300 evaluations (more steps than the grid's 200 points) and one with two between
    # two grid points: the short one is on the grid, and held at its last score when it met its target.
    long_run = (np.arange(1, 301) * 1000.0, np.zeros(300))
    short_run = (np.array([1500.0, 1600.0]), np.array([5.0, 9.0]))
    grid, matrix = figures.on_one_grid([long_run, short_run])
    assert len(grid) <= 204 and {1500.0, 1600.0} <= set(grid)
    assert np.nanmax(matrix[1]) == 9.0


def test_a_run_short_of_its_total_steps_is_marked_unfinished(tmp_path):
    for seed in (1, 2):
        write_job(tmp_path / str(seed), "pong", "ALE/Pong-v5", seed, [0.0, 5.0, 9.0], config=dict(total_steps=3000))
    logs = tmp_path / "2" / "logs.csv"
    logs.write_text("".join(logs.read_text().splitlines(keepends=True)[:-1]))  # seed 2 stopped at step 2,000
    written = report.write_report([tmp_path], tmp_path / "out", report.Options(reps=200))
    text = written["report"].read_text()
    assert "Unfinished, their last score standing in for the final one: 2 at 2,000 of 3,000." in text
    assert "| all runs | 2 (1 unfinished) | 9.00 " in text
    assert pd.read_csv(written["tasks_csv"]).loc[0, "unfinished"] == 1


def test_a_run_stopped_by_its_evaluation_target_is_finished_and_of_the_same_setting(tmp_path):
    for seed, stop_at in ((1, None), (2, 8.0), (3, 10.0)):
        config = dict(total_steps=3000, eval=dict(stop_at_return=stop_at))
        extra = [] if stop_at is None else [f"eval.stop_at_return={stop_at}"]
        write_job(tmp_path / str(seed), "pong", "ALE/Pong-v5", seed, [0.0, 5.0, 9.0], extra, config)
        logs = tmp_path / str(seed) / "logs.csv"
        logs.write_text("".join(logs.read_text().splitlines(keepends=True)[:-1]))  # each stopped at step 2,000
    written = report.write_report([tmp_path], tmp_path / "out", report.Options(reps=200))
    text = written["report"].read_text()
    # Seed 2 met its target (9 >= 8): complete. Seeds 1 (no target) and 3 (10 never met) stopped short.
    assert "Unfinished, their last score standing in for the final one: 1 at 2,000 of 3,000, 3 at 2,000" in text
    assert "| all runs | 3 (2 unfinished) |" in text  # when to stop makes no setting of its own
    # The peers' measure of the run complete at its target is read where it stopped; the others are short.
    per_run = pd.read_csv(written["runs_csv"], dtype={"run": str}).set_index("run")
    assert per_run.loc["2", "peer_step"] == 2000 and per_run.loc["2", "peer"] == 2.0
    assert per_run.loc[["1", "3"], "peer"].isna().all()


def test_normalisation_reads_the_data_file(sweep, tmp_path):
    data = yaml.safe_load(baselines.BASELINES.read_text())
    # Another random score and reference for Pong: finals 14.6 and -3.05 normalise to 1.0 and 3.05 / 20.7...
    data["ALE/Pong-v5"].update(
        random=dict(score=-3.05 * 2, source="test"),
        references=[dict(name="mine", score=14.6, measure="bound", source="test")],
    )
    data["ALE/Pong-v5"]["normalise_by"] = "mine"
    del data["HalfCheetah-v5"]  # ...and HalfCheetah without any: it is left out, and said so
    path = tmp_path / "baselines.yaml"
    path.write_text(yaml.safe_dump(data))
    written = report.write_report([sweep], tmp_path / "out", report.Options(baselines=path, reps=200))
    (aggregate,) = pd.read_csv(written["aggregates_csv"]).to_dict("records")
    normalised = [(14.6 + 6.1) / (14.6 + 6.1), (-3.05 + 6.1) / (14.6 + 6.1)]
    assert aggregate["tasks"] == 1 and aggregate["mean"] == pytest.approx(sum(normalised) / 2)
    text = written["report"].read_text()
    assert (
        "ALE/Pong-v5 by mine (the final score)" in text and "Left out: HalfCheetah-v5 (not in baselines.yaml)." in text
    )
    # Kept with its runs, the report keeps its baselines too, and the command that draws it again uses them.
    options = report.Options(baselines=path, reps=200, targets={"": 1 / 3}, keep_runs=True)
    kept = report.write_report([sweep], tmp_path / "kept", options)
    assert (tmp_path / "kept" / "baselines.yaml").read_text() == path.read_text()
    command = f"runs --out . --target {1 / 3!r} --baselines baselines.yaml --reps 200`"
    assert command in kept["report"].read_text()


def test_the_packaged_baselines_say_where_each_number_was_read():
    known = baselines.load_baselines()
    assert known["PongNoFrameskip-v4"] is known["ALE/Pong-v5"]  # aliases
    pong = known["ALE/Pong-v5"]
    assert pong.random["score"] == -20.7 and pong.normaliser()["score"] == 14.6
    assert known["NetHackScore-v0"].normaliser()["score"] == 971
    assert {t: known[t].normaliser()["score"] for t in ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5")} == {
        "HalfCheetah-v5": 1442.64,
        "Hopper-v5": 2382.86,
        "Walker2d-v5": 2287.95,
    }
    # Grid tasks paying at most 1 (a goal reached) are normalised by that bound, one entry for all.
    grid = ("MiniHack-Room-15x15-v0", "MiniHack-Room-Monster-15x15-v0", "MiniGrid-DoorKey-8x8-v0")
    assert {known[t].normaliser()["name"] for t in grid} == {"task maximum"}
    assert {known[t].normaliser()["score"] for t in grid} == {1.0}
    for task, baseline in known.items():
        assert baseline.random is None or (isinstance(baseline.random["score"], float) and baseline.random["source"])
        for reference in baseline.references:
            assert {"name", "score", "source"} <= set(reference) and reference["source"], task
        if baseline.normalise_by is not None:
            assert baseline.normaliser() is not None, f"{task}: normalise_by names no reference"
    for task, baseline in known.items():
        for reference in baseline.references:
            measure = measures.measure_of(reference)  # every reference says how it was measured
            if measure == "train_last_100":
                assert reference["steps"] and reference["seeds"], task
    # CleanRL measured on v4: HalfCheetah-v5 keeps v4's rewards and dynamics, Hopper/Walker2d/Ant-v5 do not.
    for task, comparable in [
        ("HalfCheetah-v5", True),
        ("Hopper-v5", False),
        ("Walker2d-v5", False),
        ("Hopper-v4", True),
    ]:
        cleanrl = known[task].normaliser()
        assert (known[task].why_not_comparable(cleanrl, task) is None) == comparable, task
    # The classic suite's tasks have a random score and a reference: the report gives them an IQM.
    # Normalised by the solved level (a bound: any budget), CleanRL's 500k-step figure beside it.
    for task, solved, cleanrl in [("CartPole-v1", 475.0, 490.04), ("Acrobot-v1", -100.0, -86.36)]:
        assert known[task].random["score"] < solved == known[task].normaliser()["score"]
        assert known[task].peer_budget() == 500_000
        assert {r["name"]: r["score"] for r in known[task].references}["CleanRL PPO"] == cleanrl
    assert known["MountainCar-v0"].normaliser()["name"] == "solved"


def uniform_random_return(env_id: str, episodes: int = 100) -> float:
    """The protocol at the top of baselines.yaml for the random scores this project measured."""
    import gymnasium as gym

    env = gym.make(env_id)
    env.action_space.seed(0)
    returns = []
    for episode in range(episodes):
        env.reset(seed=episode)
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


# The gymnasium tasks whose random score this project measured -> the simulator each needs, if any.
MEASURED_HERE = {"CartPole-v1": None, "Acrobot-v1": None, "MountainCar-v0": None,
                 "LunarLander-v3": "Box2D", "InvertedPendulum-v5": "mujoco"}  # fmt: skip


@pytest.mark.parametrize("task", MEASURED_HERE)
def test_the_random_scores_this_project_measured_are_what_its_protocol_gives(task):
    if MEASURED_HERE[task]:
        pytest.importorskip(MEASURED_HERE[task])
    random = baselines.load_baselines()[task].random
    assert random["source"].startswith("measured by this project")
    assert round(uniform_random_return(task), 2) == random["score"]


def test_the_command_writes_the_report(sweep, tmp_path):
    command = [sys.executable, "-m", "torchbeast_hydra.analysis.report", sweep, "--target", "0", "--reps", "200"]
    for _ in range(2):  # the second reads the sweep again, not the copies the first kept under it
        result = run_command([*command, "--keep-runs"], timeout=180)
        assert result.returncode == 0, result.stderr
        assert "## HalfCheetah-v5" in result.stdout and f"wrote {sweep / 'report' / 'report.md'}" in result.stdout
        assert "4 runs in" in result.stdout and (sweep / "report" / "runs" / "3" / "logs.csv.gz").exists()
    assert (sweep / "report" / "performance_profile.png").exists()
    bad = run_command([sys.executable, "-m", "torchbeast_hydra.analysis.report", tmp_path / "nothing"], timeout=180)
    assert bad.returncode == 2 and "is not a directory" in bad.stderr


def test_a_task_with_a_random_score_but_no_reference_is_left_out_and_says_why(tmp_path):
    for seed in (1, 2):
        write_job(tmp_path / str(seed), "minigrid", "MiniGrid-DoorKey-8x8-v0", seed, [0.0, 0.5, 0.9])
    baselines = tmp_path / "baselines.yaml"
    baselines.write_text("MiniGrid-DoorKey-8x8-v0:\n  random: {score: 0.012, source: measured}\n  references: []\n")
    written = report.write_report([tmp_path], tmp_path / "out", report.Options(baselines=baselines, reps=200))
    text = written["report"].read_text()
    assert "Left out: MiniGrid-DoorKey-8x8-v0 (no reference to normalise by in baselines.yaml)." in text
    assert "- random: 0.01 (measured)" in text
    assert_real_image(tmp_path / "out" / "curve_MiniGrid-DoorKey-8x8-v0.png")
    assert_real_image(tmp_path / "out" / "performance_profile.png")  # says why it is empty


def test_test_mode_evaluations_of_a_sweep_are_read_with_the_runs_they_played(tmp_path):
    """mode=test load_dir=SWEEP writes TEST/JOB/eval.csv with a link to each job: the report reads
    those evaluations as the jobs' own, given the sweep, the test dir, or both."""
    sweep = tmp_path / "multirun"
    trained = {("pong", "ALE/Pong-v5", 1): 0, ("pong", "ALE/Pong-v5", 2): 1}
    for (option, env_id, seed), job in trained.items():
        write_job(sweep / str(job), option, env_id, seed)  # no evaluation during training
    tested = tmp_path / "test"
    for job, final in ((0, 14.6), (1, -3.05)):
        (tested / str(job)).mkdir(parents=True)
        (tested / str(job) / "trained_run").symlink_to(sweep / str(job))
        figures = dict(episodes=10, mean_return=final, std_return=0.0, min_return=final, max_return=final)
        row = dict(step=3000, **figures, mean_length=1.0, seconds=1.0, greedy=True, seed=1)
        with open(tested / str(job) / "eval.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, list(row))
            writer.writeheader()
            writer.writerow(row)
    for paths in ([tested], [sweep, tested]):
        written = report.write_report(paths, tmp_path / "out", report.Options(metric="eval", reps=200))
        tasks = pd.read_csv(written["tasks_csv"]).set_index("task")
        assert tasks.loc["ALE/Pong-v5", "seeds"] == 2
        assert tasks.loc["ALE/Pong-v5", "final"] == pytest.approx((14.6 - 3.05) / 2)


def test_a_long_setting_is_wrapped_at_its_commas_in_the_legend():
    setting = "model.crop_size=29,model.full_map=False,optim.epochs=2,optim.minibatches=8,total_steps=1000000"
    lines = figures.legend_label(setting).splitlines()
    assert len(lines) > 1 and all(len(line) <= 56 for line in lines)
    assert " ".join(lines) == setting.replace(",", ", ")
    # A wrapped label goes below the axes (inside, it hid the curves' ends), the figure taller for it.
    for label, below in ((figures.legend_label(setting), True), ("optim.epochs=2", False)):
        fig = Figure(figsize=(7.2, 4.4), layout="constrained")
        ax = fig.subplots()
        ax.plot([0, 1], [0, 1], label=label)
        figures.place_legend(fig, ax)
        assert (len(fig.legends), ax.get_legend() is None, fig.get_figheight() > 4.4) == (below, below, below)


def test_evaluations_at_one_step_pool_their_episodes():
    evals = pd.DataFrame(
        dict(step=[100, 200, 200], episodes=[10, 10, 100], mean_return=[0.5, 1.0, 0.9])  # 200: training's, test's
    )
    pooled = tables.pooled_by_step(evals)
    assert list(pooled.index) == [100, 200]
    assert pooled[100] == 0.5 and pooled[200] == pytest.approx((10 * 1.0 + 100 * 0.9) / 110)


def test_a_seed_stopped_at_its_target_holds_its_last_score_in_the_mean(tmp_path):
    def curves(sweep, first_seed_evals):
        # Seed 1 stopped at step 2,000 (target 8); seed 2 played on to 3,000 at 0.
        for seed, evals in ((1, first_seed_evals), (2, [0.0, 0.0, 0.0])):
            config = dict(total_steps=3000, eval=dict(stop_at_return=8.0))
            write_job(sweep / str(seed), "pong", "ALE/Pong-v5", seed, evals, ["eval.stop_at_return=8.0"], config)
        loaded = sorted(runs.load([sweep]), key=lambda r: r.seed)
        return figures.seed_curves(loaded, "eval")

    grid, each, held = curves(tmp_path / "met", [0.0, 9.0])
    assert list(grid) == STEPS
    assert pd.isna(each[0, 2]) and each[0, 1] == 9.0  # its own curve ends where it stopped
    assert list(held[0]) == [0.0, 9.0, 9.0] and list(held[1]) == [0.0, 0.0, 0.0]
    # One that stopped short of a target it never met did not finish: it is not held.
    _, _, held = curves(tmp_path / "missed", [0.0, 7.0])
    assert pd.isna(held[0, 2])


def test_a_report_keeps_its_runs_and_is_drawn_again_from_them_alone(sweep, tmp_path):
    tested = tmp_path / "test" / "0"  # a mode=test evaluation of job 0 goes along with it
    tested.mkdir(parents=True)
    (tested / "trained_run").symlink_to(sweep / "0")
    row = dict(step=4000, episodes=10, mean_return=21.0, std_return=0.0, min_return=21.0, max_return=21.0)
    row.update(mean_length=1.0, seconds=1.0, greedy=True, seed=1)
    with open(tested / "eval.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(row))
        writer.writeheader()
        writer.writerow(row)
    hydra_yaml = sweep / "0" / ".hydra" / "hydra.yaml"  # Hydra's own config holds much more than the choices
    hydra = yaml.safe_load(hydra_yaml.read_text())
    hydra["hydra"]["runtime"]["cwd"] = str(tmp_path)
    hydra["hydra"]["job"] = dict(name="__main__", chdir=False)
    hydra_yaml.write_text(yaml.safe_dump(hydra))
    options = report.Options(targets={"": 1.0}, reps=200, keep_runs=True)
    first = report.write_report([sweep, tmp_path / "test"], tmp_path / "out", options)
    kept = tmp_path / "out" / "runs"
    assert not (kept / "multirun" / "0" / "logs.csv").exists()  # gzipped: logs.csv.gz
    with gzip.open(kept / "multirun" / "0" / "logs.csv.gz", "rt", newline="") as f:
        assert csv.DictReader(f).fieldnames == list(runs.REPORT_COLUMNS)  # the columns read, no more
    kept_rows, source_rows = metrics.read_rows(kept / "multirun" / "0"), metrics.read_rows(sweep / "0")
    assert [(r["step"], r["episode_returns"]) for r in kept_rows] == [
        (r["step"], r["episode_returns"]) for r in source_rows
    ]  # the same rows back
    hydra_kept = yaml.safe_load((kept / "multirun" / "0" / ".hydra" / "hydra.yaml").read_text())
    assert list(hydra_kept) == ["hydra"] and list(hydra_kept["hydra"]) == ["runtime"]  # the choices, no more
    assert runs.read_config(kept / "multirun" / "0") == runs.read_config(sweep / "0")
    assert "`python -m torchbeast_hydra.analysis.report runs --out . --target 1 --reps 200`, run in this dir" in (
        first["report"].read_text()
    )
    assert not (tmp_path / "out" / baselines.KEPT_BASELINES).exists()  # the package's: nothing to keep
    assert not [p for p in kept.rglob("*") if p.is_symlink()]  # no link back to a run: a cycle to site builders
    again = report.write_report([kept], tmp_path / "again", dataclasses.replace(options, keep_runs=False))
    for name in ("tasks_csv", "aggregates_csv"):
        pd.testing.assert_frame_equal(pd.read_csv(first[name]), pd.read_csv(again[name]))
    best = pd.read_csv(again["tasks_csv"]).set_index("task").loc["ALE/Pong-v5", "best"]
    assert best == pytest.approx((21.0 - 3.05) / 2)  # seed 1's test-mode evaluation came along


def test_a_runs_logs_thin_in_place_to_the_report_columns_and_stop_at_a_torn_row(tmp_path):
    logs = tmp_path / "logs.csv"
    logs.write_text("step,time_s,episode_returns,total_loss\n10,1.0,[1.0],0.5\n20,2.0,[],0.4\n30,3.0\n")
    runs.write_report_columns(logs, logs)
    with open(logs, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(runs.REPORT_COLUMNS)
    assert [(r["step"], r["episode_returns"]) for r in rows] == [("10", "[1.0]"), ("20", "[]")]


def test_kept_logs_write_each_return_as_the_shortest_text_of_its_float32_value(tmp_path):
    returns = [float(np.float32(0.3826562464237213)), -500.0, float(np.float32(1234.56789))]
    logs = tmp_path / "logs.csv"
    logs.write_text(f'step,time_s,episode_returns\n10,1.0,"{json.dumps(returns)}"\n')
    runs.write_report_columns(logs, logs)
    kept = metrics.read_rows(logs)[0]["episode_returns"]
    assert np.array_equal(np.float32(kept), np.float32(returns))  # the same float32 values
    assert "0.38265625," in logs.read_text() and "0.3826562464237213" not in logs.read_text()


def test_kept_logs_are_gzipped_the_same_rows_give_the_same_bytes_and_a_plain_log_comes_first(tmp_path, monkeypatch):
    logs = tmp_path / "run" / "logs.csv"
    logs.parent.mkdir()
    logs.write_text('step,time_s,episode_returns,total_loss\n10,1.0,"[1.5, -2.0]",0.5\n20,2.0,[],0.4\n')
    first, second = tmp_path / "a" / "logs.csv.gz", tmp_path / "b" / "logs.csv.gz"
    for dest, now in ((first, 1e9), (second, 2e9)):  # written at different times
        monkeypatch.setattr(gzip.time, "time", lambda now=now: now)
        dest.parent.mkdir()
        runs.write_report_columns(logs, dest)
    assert first.read_bytes()[:2] == b"\x1f\x8b"  # gzip's magic
    assert first.read_bytes() == second.read_bytes()  # no timestamp: a redrawn report changes no byte
    assert metrics.logs_file(first.parent) == first and metrics.logs_file(tmp_path) is None
    assert [(r["step"], r["episode_returns"]) for r in metrics.read_rows(first.parent)] == [(10, [1.5, -2.0]), (20, [])]
    (first.parent / "logs.csv").write_text("step,time_s,episode_returns\n30,3.0,[]\n")
    assert metrics.logs_file(first.parent).name == "logs.csv"  # a run's own log, when both are there
    assert runs.find_runs(tmp_path) == [first.parent, second.parent, logs.parent]  # each dir once, a and b both logs


def test_the_peers_measure_is_the_last_100_training_episodes_by_the_budget():
    # Updates at 1,000 steps each; episode returns as they ended.
    train = pd.DataFrame(
        dict(step=[1000, 2000, 3000, 4000], episode_returns=[[1.0] * 60, [2.0] * 30, [3.0] * 30, [9.0]])
    )
    figure = measures.last_episodes_mean(train, budget=2500)  # the update at 3,000 is the first past 2,500
    assert figure == (pytest.approx((40 * 1.0 + 30 * 2.0 + 30 * 3.0) / 100), 3000, 100)
    assert measures.last_episodes_mean(train, budget=1000) == (1.0, 1000, 60)  # fewer than 100: all there are
    assert measures.last_episodes_mean(train, budget=4001) is None  # never reached the budget


def test_few_seeds_get_their_range_and_five_an_interval():
    assert measures.spread([2.0], reps=500, seed=0) == (2.0, 2.0, 2.0, "one seed")
    three = measures.spread([1.0, 5.0, 3.0], reps=500, seed=0)
    assert three == (3.0, 1.0, 5.0, "range")
    five = measures.spread([1.0, 2.0, 3.0, 4.0, 5.0], reps=2000, seed=0)
    assert five.kind == "95% interval" and 1.0 < five.low < 3.0 < five.high < 5.0


def test_a_peer_reference_is_compared_on_its_measure_only_where_the_env_matches(tmp_path):
    """Runs whose training episodes return the seed (1.0, 2.0) on Hopper-v5 and HalfCheetah-v5
    against a v4 figure at their budget: HalfCheetah (same dynamics) is compared on the peers'
    measure, Hopper (another version) is said not to be comparable."""
    sweep = tmp_path / "sweep"
    for job, (option, env_id, seed) in enumerate(
        [(o, e, s) for o, e in [("mujoco", "HalfCheetah-v5"), ("mujoco", "Hopper-v5")] for s in (1, 2)]
    ):
        write_job(sweep / str(job), option, env_id, seed, [0.0, 0.0, 0.0])
    data = yaml.safe_load(baselines.BASELINES.read_text())
    for task in ("HalfCheetah-v5", "Hopper-v5"):
        data[task]["random"]["score"] = 0.0
        (cleanrl,) = [r for r in data[task]["references"] if r["name"] == "CleanRL PPO"]
        cleanrl.update(score=4.0, steps=2500)
    path = tmp_path / "baselines.yaml"
    path.write_text(yaml.safe_dump(data))
    written = report.write_report([sweep], tmp_path / "out", report.Options(baselines=path, reps=200))
    (aggregate,) = pd.read_csv(written["aggregates_csv"]).to_dict("records")
    # The peers' measure at 2,500 steps (the update at 3,000): seed 1's episodes return 1, seed 2's 2.
    assert aggregate["tasks"] == 1 and aggregate["mean"] == pytest.approx((1.0 / 4 + 2.0 / 4) / 2)
    text = written["report"].read_text()
    assert "HalfCheetah-v5 by CleanRL PPO (the last 100 training episodes at 2,500 steps)" in text
    assert "Hopper-v5 (CleanRL PPO: measured on Hopper-v4, these runs are on Hopper-v5" in text
    tasks = pd.read_csv(written["tasks_csv"]).set_index("task")
    assert (
        tasks.loc["HalfCheetah-v5", "peer"] == pytest.approx(1.5) and tasks.loc["HalfCheetah-v5", "spread"] == "range"
    )
    per_run = pd.read_csv(written["runs_csv"], dtype={"run": str}).set_index("run")
    assert per_run["peer"].to_dict() == {"0": 1.0, "1": 2.0, "2": 1.0, "3": 2.0}  # each run's, beside its final
    assert (per_run["peer_step"] == 3000).all() and (per_run["peer_episodes"] == 3).all()
    assert "| 0 | 1 | 0.00 | 1.00 (3 episodes, at step 3,000) |" in text


def test_a_seed_short_of_the_budget_is_counted_and_keeps_the_task_out_of_the_aggregate(tmp_path):
    """Censoring: a run that never reached the reference's budget has no peers' figure; the table says
    how many seeds reached it, and the task is not normalised on a subset of its seeds."""
    sweep = tmp_path / "sweep"
    for seed in (1, 2):
        write_job(sweep / str(seed), "mujoco", "HalfCheetah-v5", seed, [0.0, 0.0, 0.0])
    short = sweep / "3"
    write_run(
        short,
        ["env=mujoco", "seed=3"],
        3,
        [(1000, [3.0], 0.5), (2000, [3.0], 0.5)],
        config=dict(env=dict(id="HalfCheetah-v5")),
        choices=dict(env="mujoco"),
        steps_per_s=100.0,
    )
    data = yaml.safe_load(baselines.BASELINES.read_text())
    (cleanrl,) = [r for r in data["HalfCheetah-v5"]["references"] if r["name"] == "CleanRL PPO"]
    cleanrl.update(steps=2500)
    path = tmp_path / "baselines.yaml"
    path.write_text(yaml.safe_dump(data))
    written = report.write_report([sweep], tmp_path / "out", report.Options(baselines=path, metric="train", reps=200))
    tasks = pd.read_csv(written["tasks_csv"]).set_index("task")
    assert tasks.loc["HalfCheetah-v5", "peer_seeds"] == 2 and tasks.loc["HalfCheetah-v5", "peer"] == pytest.approx(1.5)
    text = written["report"].read_text()
    assert "1.50 (range 1.00 to 2.00) (2/3 seeds reached the budget)" in text
    assert "HalfCheetah-v5 (1 of 3 runs short of CleanRL PPO's budget, 2,500 steps: not comparable)" in text
    assert "No task has both a random score and a comparable reference" in text


def test_runs_meant_to_stop_before_the_references_budget_get_the_peers_measure_at_their_own(tmp_path):
    """A 3,000-step suite beside CleanRL's 1M-step figure: each run's last 100 training episodes at
    its own total_steps are shown, and not set against the 1M-step figure."""
    sweep = tmp_path / "sweep"
    for seed in (1, 2):
        write_job(sweep / str(seed), "mujoco", "HalfCheetah-v5", seed, [0.0, 0.0, 0.0], config=dict(total_steps=3000))
    written = report.write_report([sweep], tmp_path / "out", report.Options(reps=200))
    tasks = pd.read_csv(written["tasks_csv"]).set_index("task")
    assert (
        tasks.loc["HalfCheetah-v5", "peer"] == pytest.approx(1.5) and tasks.loc["HalfCheetah-v5", "peer_budget"] == 3000
    )
    text = written["report"].read_text()
    assert "last 100 training episodes at 3,000 steps" in text
    assert "HalfCheetah-v5 (2 of 2 runs short of CleanRL PPO's budget, 1,000,000 steps: not comparable)" in text
    assert "its measure, but these runs were read at 3,000 steps, short of its budget: not compared" in text


def test_dopamines_measure_is_the_training_episodes_that_ended_in_the_last_iteration():
    """Rows of episodes that ended since the row before: the window (budget - iteration, first
    update at or past budget] holds the episodes of the rows at 2,000 and 3,000, not 1,000's."""
    train = pd.DataFrame(dict(step=[1000, 2000, 3000, 4000], episode_returns=[[50.0] * 9, [1.0, 3.0], [2.0], [90.0]]))
    figure = measures.iteration_mean(train, budget=2500, iteration_steps=1500)  # rows after 1,000, up to 3,000
    assert figure == (pytest.approx(2.0), 3000, 3)
    assert measures.iteration_mean(train, budget=3000, iteration_steps=1000) == (2.0, 3000, 1)  # its own row only
    assert measures.iteration_mean(train, budget=4001, iteration_steps=1000) is None  # never reached the budget
    assert measures.iteration_mean(pd.DataFrame(dict(step=[1000], episode_returns=[[]])), 1000, 500) is None
    # A reference's measure picks the window: Dopamine's iteration, else CleanRL's last 100 episodes.
    dopamine = dict(name="Dopamine DQN", measure="train_iteration", iteration_steps=1500, steps=2500)
    assert measures.peer_figure(train, 2500, dopamine) == figure
    assert measures.peer_figure(train, 2500)[0] == pytest.approx((9 * 50.0 + 1.0 + 3.0 + 2.0) / 12)


DOPAMINE_PROTOCOL = dict(sticky_action_prob=0.25, full_action_space=False, frame_skip=4)


def test_a_reference_with_env_settings_compares_only_with_runs_that_have_them():
    reference = dict(name="Dopamine DQN", measure="train_iteration", env_settings=DOPAMINE_PROTOCOL)
    sticky = {f"env.{k}": v for k, v in DOPAMINE_PROTOCOL.items()}
    plain = {**sticky, "env.sticky_action_prob": 0.0}
    task = "ALE/Breakout-v5"
    assert measures.why_not_comparable(reference, task, configs=[sticky, sticky]) is None
    why = measures.why_not_comparable(reference, task, configs=[sticky, plain])
    assert why == "another env protocol (env.sticky_action_prob=0.0 in 1 of 2 runs, the reference's 0.25)"
    # A run that does not record a setting (made before it existed) is not taken to have it.
    unrecorded = {k: v for k, v in sticky.items() if k != "env.frame_skip"}
    assert "env.frame_skip=not recorded" in measures.why_not_comparable(reference, task, configs=[unrecorded])
    # An anchor (the human score) compares with any run.
    assert measures.why_not_comparable(dict(name="human", measure="human"), task, configs=[plain]) is None


def test_dopamines_figures_are_set_beside_runs_of_its_protocol_only(tmp_path):
    """Breakout runs with and without sticky actions against a Dopamine-style reference measured per
    iteration (1,500 steps before 2,500 here): both get the figure, only the sticky ones are compared."""
    sweep = tmp_path / "sweep"
    for job, (sticky, seed) in enumerate([(0.25, 1), (0.25, 2), (0.0, 1)]):
        env = dict(id="ALE/Breakout-v5", **{**DOPAMINE_PROTOCOL, "sticky_action_prob": sticky})
        rows = [(1000, [50.0], 0.5), (2000, [float(seed)], 0.5), (3000, [float(seed)], 0.5)]
        write_run(
            sweep / str(job),
            ["env=breakout", f"seed={seed}", f"env.sticky_action_prob={sticky}"],
            seed,
            rows,
            config=dict(env=env, total_steps=3000),
            choices=dict(env="breakout"),
            steps_per_s=100.0,
        )
    data = yaml.safe_load(baselines.BASELINES.read_text())
    breakout = data["ALE/Breakout-v5"]
    dopamine = dict(
        name="Dopamine DQN",
        score=5.0,
        measure="train_iteration",
        steps=2500,
        iteration_steps=1500,
        seeds=5,
        env_settings=DOPAMINE_PROTOCOL,
        source="a test",
    )
    breakout.update(random=dict(score=0.0, source="a test"), normalise_by="Dopamine DQN", references=[dopamine])
    path = tmp_path / "baselines.yaml"
    path.write_text(yaml.safe_dump(data))
    written = report.write_report([sweep], tmp_path / "out", report.Options(baselines=path, metric="train", reps=200))
    per_run = pd.read_csv(written["runs_csv"], dtype={"run": str}, keep_default_na=False).set_index("run")
    # Each run's episodes of its last iteration (the rows at 2,000 and 3,000): its seed, twice.
    assert per_run["peer"].astype(float).to_dict() == {"0": 1.0, "1": 2.0, "2": 1.0}
    assert (per_run["peer_measure"] == "train_iteration").all() and (per_run["peer_episodes"].astype(int) == 2).all()
    assert per_run.loc[["0", "1"], "peer_other_settings"].tolist() == ["", ""]
    assert "env.sticky_action_prob=0.0, the reference's 0.25" in per_run.loc["2", "peer_other_settings"]
    # Normalised on the sticky setting only (mean 1.5 of 5), the other left out with why.
    (aggregate,) = pd.read_csv(written["aggregates_csv"]).to_dict("records")
    assert aggregate["runs"] == 2 and aggregate["mean"] == pytest.approx(1.5 / 5)
    text = written["report"].read_text()
    assert "env.sticky_action_prob=0.0 (1 run; Dopamine DQN: another env protocol" in text
    assert "training episodes of the last 1,500 steps at 2,500 steps" in text
    only = "compared with the 2 of 3 runs that have its env settings only: another env protocol"
    assert f"{only} (env.sticky_action_prob=0.0 in 1 of 3 runs" in text


def test_dopamines_packaged_figures_name_their_protocol_and_refuse_the_kept_run_without_it():
    """baselines.yaml's Dopamine figures (iteration 9: 9M to 10M frames) need sticky actions; the kept
    Breakout run of docs/reports/atari-10m has none, so it is never set beside them."""
    known = baselines.load_baselines()
    kept = runs.read_config(REPO / "docs/reports/atari-10m/runs/env=breakout,seed=1")
    for task in ("ALE/Breakout-v5", "ALE/SpaceInvaders-v5", "ALE/BeamRider-v5", "ALE/Pong-v5"):
        dopamine = [r for r in known[task].references if r["name"].startswith("Dopamine")]
        assert {r["name"] for r in dopamine} == {"Dopamine DQN", "Dopamine C51", "Dopamine Rainbow", "Dopamine IQN"}
        for reference in dopamine:
            assert reference["measure"] == "train_iteration" and reference["seeds"] == 5
            assert (reference["steps"], reference["iteration_steps"]) == (2_500_000, 250_000)
            assert reference["env_settings"]["sticky_action_prob"] == 0.25
        assert known[task].peer_reference()["name"] == "Dopamine DQN"
        assert "sticky_action_prob=0.0" in known[task].why_not_comparable(dopamine[0], task, [kept])
        assert known[task].why_not_comparable(dopamine[0], task, [{**kept, "env.sticky_action_prob": 0.25}]) is None


def test_populations_laid_out_alike_under_two_paths_get_two_names(tmp_path):
    # A benchmark's arms: runs/pbt/seed1/pbt and runs/fixed/seed1/pbt. One name each, so neither
    # arm's population figure overwrites the other's.
    arms = [tmp_path / "runs" / arm / "seed1" for arm in ("pbt", "fixed")]
    names = [report._population_name(arm / "pbt", arms) for arm in arms]
    assert names == ["pbt/seed1/pbt", "fixed/seed1/pbt"]
    assert report._population_name(arms[0] / "pbt", arms[:1]) == "seed1/pbt"  # one path: from its parent


def test_a_kept_report_takes_runs_finished_since_beside_its_kept_ones(sweep, tmp_path):
    """A seed that finishes in a later session joins the report: its kept runs stay as they are."""
    options = report.Options(targets={"": 1.0}, reps=200, keep_runs=True)
    report.write_report([sweep / "0", sweep / "1"], tmp_path / "out", options)
    kept = tmp_path / "out" / "runs"
    assert sorted(p.name for p in kept.iterdir() if p.is_dir()) == ["0", "1"]
    before = (kept / "0" / "logs.csv.gz").read_bytes()
    later = tmp_path / "later" / "seed3"
    write_job(later, "pong", "ALE/Pong-v5", 3, [0.0, 5.0, 9.0])
    again = report.write_report([kept, later], tmp_path / "out", options)
    assert sorted(p.name for p in kept.iterdir() if p.is_dir()) == ["0", "1", "seed3"]
    assert (kept / "0" / "logs.csv.gz").read_bytes() == before  # the kept copies stay as they are
    assert pd.read_csv(again["tasks_csv"]).set_index("task").loc["ALE/Pong-v5", "seeds"] == 3  # seeds 1, 2 and 3
    with pytest.raises(ValueError, match="a run named seed3 is kept already"):
        report.write_report([kept, later], tmp_path / "out", options)
    with pytest.raises(ValueError, match="keeps runs this report does not read"):
        report.write_report([kept / "0", tmp_path / "later"], tmp_path / "out", options)
