"""Analysis: loading runs and sweeps, aggregating seeds, plots, the plot command and the notebook."""

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from torchbeast_hydra.analysis import figures
from torchbeast_hydra.analysis import runs as analysis

from helpers import assert_real_image, csv_dicts, run_command, sweep_job_dir, write_run

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "analysis.ipynb"
PNGS = ["returns.png", "sps.png", "losses.png", "final_returns.png"]


# Episode returns per (learning rate, seed): three updates each, at steps 10, 20, 30.
RETURNS = {
    ("0.1", 1): [[1.0], [2.0, 3.0], [4.0]],
    ("0.1", 2): [[], [5.0], [6.0, 7.0]],
    ("0.2", 1): [[10.0], [], [20.0]],
    ("0.2", 2): [[30.0], [40.0], [50.0]],
}


@pytest.fixture
def synthetic_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    for job, ((lr, seed), returns) in enumerate(RETURNS.items()):
        rows = [(10 * (i + 1), r, float(job + i)) for i, r in enumerate(returns)]
        write_run(sweep / str(job), ["env=cartpole", f"seed={seed}", f"optim.learning_rate={lr}"], seed, rows)
    (sweep / "multirun.yaml").write_text("{}\n")
    return sweep


def test_load_runs_has_a_row_per_update_with_overrides_seed_and_setting(synthetic_sweep):
    df = analysis.load_runs(synthetic_sweep)
    assert len(df) == 12 and list(df["run"].unique()) == ["0", "1", "2", "3"]
    assert df.attrs["swept_keys"] == ["optim.learning_rate"]  # not env (constant), not seed
    assert set(df["env"]) == {"cartpole"}
    assert list(df.groupby("run")["seed"].first()) == [1, 2, 1, 2]
    assert analysis.settings(df) == ["optim.learning_rate=0.1", "optim.learning_rate=0.2"]
    # recent_return: the running mean of the last `window` episodes.
    run0 = df[df["run"] == "0"]["recent_return"].tolist()
    assert run0 == [1.0, 2.0, 2.5]
    windowed = analysis.load_runs(synthetic_sweep, window=2)
    run1 = windowed[windowed["run"] == "1"]["recent_return"].tolist()
    assert math.isnan(run1[0]) and run1[1:] == [5.0, 6.5]  # no episode yet; then [5]; [6, 7]


def test_final_returns_match_hand_computed_numbers(synthetic_sweep):
    df = analysis.load_runs(synthetic_sweep)
    per_run = analysis.final_returns(df, last_n=2).set_index("run")
    assert per_run["final_return"].tolist() == [3.5, 6.5, 15.0, 45.0]  # mean of the last 2 each
    assert per_run["episodes"].tolist() == [4, 3, 2, 3] and set(per_run["steps"]) == {30}
    table = analysis.final_returns_by_setting(df, last_n=2)
    low, high = table.loc["optim.learning_rate=0.1"], table.loc["optim.learning_rate=0.2"]
    assert low["mean"] == 5.0 and low["std"] == pytest.approx(statistics.stdev([3.5, 6.5]))
    assert high["mean"] == 30.0 and high["std"] == pytest.approx(statistics.stdev([15.0, 45.0]))
    assert (low["runs"], low["min"], low["max"]) == (2, 3.5, 6.5)


def test_learning_curve_is_the_mean_and_std_across_seeds(synthetic_sweep):
    df = analysis.load_runs(synthetic_sweep)
    curve = analysis.learning_curve(df, "total_loss", bins=3)
    low = curve[curve["setting"] == "optim.learning_rate=0.1"]
    # Runs 0 and 1 log total_loss = job + update index: (0, 1, 2) and (1, 2, 3).
    assert low["step"].tolist() == [10.0, 20.0, 30.0]
    assert low["mean"].tolist() == [0.5, 1.5, 2.5]
    assert low["std"].tolist() == pytest.approx([np.sqrt(0.5)] * 3)
    assert low["runs"].tolist() == [2, 2, 2]


def test_a_single_run_dir_loads_as_one_setting(synthetic_sweep):
    df = analysis.load_runs(synthetic_sweep / "2")
    assert df["run"].unique().tolist() == ["2"] and analysis.settings(df) == [analysis.ALL_RUNS]
    assert analysis.final_returns_by_setting(df, last_n=1).loc[analysis.ALL_RUNS, "mean"] == 20.0


def test_runs_are_found_in_natural_order_and_wandb_dirs_are_skipped(tmp_path):
    for job in (10, 2, 1):
        write_run(tmp_path / str(job), [f"seed={job}"], job, [(1, [1.0], 0.0)])
    (tmp_path / "1" / "wandb" / "x").mkdir(parents=True)
    (tmp_path / "1" / "wandb" / "x" / "logs.csv").write_text("step\n1\n")
    assert [p.name for p in analysis.find_runs(tmp_path)] == ["1", "2", "10"]
    # Only the seed varies: one setting.
    assert analysis.settings(analysis.load_runs(tmp_path)) == [analysis.ALL_RUNS]


def test_runs_and_sweeps_load_together_and_what_differs_in_their_configs_is_swept(tmp_path):
    # A run started with the defaults, and a seed sweep at another learning rate.
    config = dict(env=dict(id="CartPole-v1"), optim=dict(learning_rate=0.0006))
    write_run(tmp_path / "runs" / "a", [], 1, [(10, [1.0], 0.0)], config=config)
    for seed in (1, 2):
        lr = dict(config, optim=dict(learning_rate=0.001))
        write_run(tmp_path / "sweep" / str(seed), [f"seed={seed}"], seed, [(10, [2.0 * seed], 0.0)], config=lr)
    df = analysis.load_runs([tmp_path / "runs" / "a", tmp_path / "sweep", tmp_path / "sweep" / "1"])
    assert df["run"].tolist() == ["runs/a", "sweep/1", "sweep/2"]  # each run once, named from the common parent
    assert set(df.attrs["swept"]) == {"seed", "optim.learning_rate"} and df.attrs["swept_keys"] == [
        "optim.learning_rate"
    ]
    assert analysis.settings(df) == ["optim.learning_rate=0.0006", "optim.learning_rate=0.001"]
    table = analysis.final_returns_by_setting(df)
    assert table.loc["optim.learning_rate=0.001", "mean"] == 3.0 and table.loc["optim.learning_rate=0.001", "runs"] == 2


def test_a_config_group_that_differs_stands_for_its_keys():
    pong = {"env": "pong", "env.id": "ALE/Pong-v5", "seed": 1, "batch_size": 8}
    breakout = {"env": "breakout", "env.id": "ALE/Breakout-v5", "seed": 1, "batch_size": 8}
    assert analysis.differing_keys([pong, breakout]) == ["env"]
    assert analysis.differing_keys([pong, breakout], typed={"env.id"}) == ["env", "env.id"]
    assert analysis.differing_keys([pong, dict(pong, seed=2)]) == ["seed"]


def test_a_key_the_code_gained_between_runs_makes_no_setting_unless_typed():
    older = {"env": "pong", "seed": 1, "batch_size": 8}
    newer = dict(older, seed=2, ablation="none")  # the same command, run after the key was added
    assert analysis.differing_keys([older, newer]) == ["seed"]
    assert analysis.differing_keys([older, newer, dict(newer, ablation="relu")]) == ["seed", "ablation"]
    assert analysis.differing_keys([older, newer], typed={"ablation"}) == ["seed", "ablation"]  # +ablation=none


def test_runs_that_predate_a_key_join_the_runs_that_left_it_at_its_default(tmp_path):
    """Two seeds of a preset run before the code gained model.feedback, one after it, and one typing
    model.feedback=false: the preset's three seeds are one setting, the typed run another."""
    old = dict(env=dict(id="Hopper-v4"), optim=dict(learning_rate=0.0003))
    new = dict(old, model=dict(feedback=True))
    for seed, config, overrides in ((1, old, []), (2, old, []), (3, new, [])):
        write_run(tmp_path / "preset" / str(seed), overrides, seed, [(10, [float(seed)], 0.0)], config=config)
    off = dict(old, model=dict(feedback=False))
    write_run(tmp_path / "no_feedback" / "1", ["model.feedback=false"], 1, [(10, [9.0], 0.0)], config=off)
    df = analysis.load_runs(tmp_path)
    assert analysis.settings(df) == ["model.feedback=False", "model.feedback=True"]
    assert df.groupby("setting")["run"].nunique().to_dict() == {"model.feedback=False": 1, "model.feedback=True": 3}
    loaded = analysis.load(tmp_path)
    analysis.assign_settings(loaded)
    assert sorted(r.setting for r in loaded) == ["model.feedback=False", *["model.feedback=True"] * 3]
    # A default that changed between runs is no one value: the runs lacking the key stay apart.
    changed = [{"seed": 1}, {"seed": 2, "model.feedback": True}, {"seed": 3, "model.feedback": False}]
    assert "model.feedback" not in analysis.with_gained_keys(changed, [set(), set(), set()])[0]
    assert analysis.with_gained_keys(changed[:2], [set(), set()])[0]["model.feedback"] is True


def test_group_choices_are_read_from_the_runs_hydra_config(tmp_path):
    for name, env in (("pong", "ALE/Pong-v5"), ("breakout", "ALE/Breakout-v5")):
        write_run(tmp_path / name, [], 1, [(10, [1.0], 0.0)], config=dict(env=dict(id=env)), choices=dict(env=name))
    df = analysis.load_runs(tmp_path)
    assert df.attrs["swept"] == ["env"] and analysis.settings(df) == ["env=breakout", "env=pong"]


def test_plot_command_takes_several_dirs_and_reports_a_seed_sweep(tmp_path):
    for seed in (1, 2):
        write_run(tmp_path / f"run{seed}", [f"seed={seed}"], seed, [(10, [1.0], 0.5), (20, [2.0], 0.25)])
    result = run_command(
        [sys.executable, "-m", "torchbeast_hydra.analysis", tmp_path / "run1", tmp_path / "run2"], timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "2 runs in" in result.stdout and "swept: seed (aggregated)" in result.stdout
    assert (tmp_path / "plots" / "final_returns.csv").exists()  # the dirs' common parent


def test_latest_runs_dir_is_the_newest_run_or_sweep(synthetic_sweep, tmp_path):
    outputs = tmp_path / "outputs"
    sweep = outputs / "multirun" / "2024-01-01" / "00-00-00"
    sweep.parent.mkdir(parents=True)
    synthetic_sweep.rename(sweep)
    assert analysis.latest_runs_dir(outputs) == sweep
    single = outputs / "2024-01-02" / "00-00-00"
    write_run(single, [], 1, [(1, [1.0], 0.0)])
    later = time.time() + 10
    os.utime(single / "logs.csv", (later, later))
    assert analysis.latest_runs_dir(outputs) == single
    with pytest.raises(FileNotFoundError, match="RUNS_DIR"):
        analysis.latest_runs_dir(tmp_path / "nothing")


def test_plot_all_writes_images_and_table(synthetic_sweep, tmp_path):
    paths = figures.plot_all(analysis.load_runs(synthetic_sweep), tmp_path / "plots", last_n=2)
    assert sorted(p.name for p in paths.values()) == sorted([*PNGS, "final_returns.csv"])
    for name in PNGS:
        assert_real_image(tmp_path / "plots" / name)


# A real sweep: two seeds of two learning rates, through the CLI (tests/conftest.py's tiny_sweep).


def hand_final_return(run_dir, last_n):
    returns = [r for row in csv_dicts(run_dir / "logs.csv") for r in json.loads(row["episode_returns"])]
    return sum(returns[-last_n:]) / len(returns[-last_n:])


@pytest.mark.slow
def test_real_sweep_loads_with_seeds_aggregated_per_learning_rate(tiny_sweep):
    df = analysis.load_runs(tiny_sweep)
    assert df["run"].nunique() == 4 and df.attrs["swept_keys"] == ["optim.learning_rate"]
    assert analysis.settings(df) == ["optim.learning_rate=0.001", "optim.learning_rate=0.003"]
    table = analysis.final_returns_by_setting(df, last_n=20)
    by_hand = {
        lr: [
            hand_final_return(sweep_job_dir(tiny_sweep, f"seed={seed}", f"optim.learning_rate={lr}"), 20)
            for seed in (1, 2)
        ]
        for lr in ("0.003", "0.001")
    }
    for lr, values in by_hand.items():
        row = table.loc[f"optim.learning_rate={lr}"]
        assert row["mean"] == pytest.approx(statistics.mean(values))
        assert row["std"] == pytest.approx(statistics.stdev(values))
        assert row["runs"] == 2


@pytest.mark.slow
def test_notebook_runs_headless_on_a_sweep_and_writes_its_plots(tiny_sweep, tmp_path, monkeypatch):
    out_dir = tmp_path / "figures"
    monkeypatch.setenv("RUNS_DIR", str(tiny_sweep))
    monkeypatch.setenv("OUT_DIR", str(out_dir))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert "parameters" in notebook.cells[1].metadata.get("tags", [])
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    for name in PNGS:
        assert_real_image(out_dir / name)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    report_pngs = sorted((out_dir / "report").glob("*.png"))  # the report's: a curve per task, the profile
    assert report_pngs and all(assert_real_image(path) is None for path in report_pngs)
    assert sum("image/png" in o.get("data", {}) for o in outputs) == len(PNGS) + len(report_pngs)
    text = json.dumps([o.get("data", {}).get("text/plain", "") for o in outputs])
    assert "optim.learning_rate=0.001" in text and "optim.learning_rate=0.003" in text
    markdown = json.dumps([o.get("data", {}).get("text/markdown", "") for o in outputs])
    assert "CartPole-v1" in markdown and (out_dir / "report" / "report.md").exists()  # the report's tables


@pytest.mark.slow
def test_plot_command_writes_the_plots_and_prints_the_table(tiny_sweep, tmp_path):
    out_dir = tmp_path / "cli"
    result = run_command(
        [sys.executable, "-m", "torchbeast_hydra.analysis", tiny_sweep, "--out", out_dir, "--last-n", "20"], timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "4 runs" in result.stdout and "swept: optim.learning_rate, seed (seeds aggregated" in result.stdout
    assert "optim.learning_rate=0.001" in result.stdout
    for name in PNGS:
        assert_real_image(out_dir / name)
    table = {row["setting"]: float(row["mean"]) for row in csv_dicts(out_dir / "final_returns.csv")}
    expected = statistics.mean(
        hand_final_return(sweep_job_dir(tiny_sweep, f"seed={seed}", "optim.learning_rate=0.001"), 20) for seed in (1, 2)
    )
    assert table["optim.learning_rate=0.001"] == pytest.approx(expected)


def test_plot_command_without_runs_fails_clearly(tmp_path):
    result = run_command([sys.executable, "-m", "torchbeast_hydra.analysis", tmp_path], timeout=60)
    assert result.returncode == 2 and "no runs" in result.stderr


def test_settings_never_differ_by_how_runs_log_or_where_they_write(tmp_path):
    """Two seeds whose runs differ only in logging and output keys are one setting, not two."""
    for seed in (1, 2):
        logging = [f"logger.tensorboard={seed == 1}", f"checkpoint_interval_s={60 * seed}"]
        write_run(tmp_path / f"run{seed}", [f"seed={seed}", *logging], seed, [(100, [1.0], 0.5)])
    df = analysis.load_runs(tmp_path)
    assert df.attrs["swept_keys"] == [] and set(df["setting"]) == {analysis.ALL_RUNS}
