"""Runs and sweeps back from disk: logs.csv + .hydra/ of each run into one pandas DataFrame.

    df = load_runs("outputs/multirun/2024-05-01/12-00-00")   # a sweep, one run dir, or a list of them
    final_returns_by_setting(df)                              # the table of final returns
    learning_curve(df, "recent_return")                       # mean and spread across seeds

One row per logs.csv row, plus: `run` (the run dir, relative to what was loaded), one column per
override key (as typed on the command line, e.g. `optim.learning_rate`) and per swept key, `seed`,
`setting` (the swept keys other than the seed, e.g. `optim.learning_rate=0.001`: runs that differ
only in seed share it), and `recent_return` (the mean return of the run's last `window` episodes
at that row, the curve the progress line shows).

What was swept is read from the runs themselves: the config keys (and config group choices, e.g.
`env`) whose values differ between the runs loaded, whatever commands started them.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import pandas as pd
import yaml

from torchbeast_hydra.logs.metrics import (
    CSV_FIELDS,
    KEPT_LOGS,
    LOGS,
    TRAINED_RUN_LINK,
    logs_file,
    open_csv,
    read_rows,
    recent_means,
)
from torchbeast_hydra.logs.sweep_record import is_run_control

RETURN = "recent_return"
SEED = "seed"
ALL_RUNS = "all runs"  # the setting of every run when nothing but the seed was swept
# The task is the env id; the env option (and what it brings) is the same within a task.
TASK_KEYS = ("env", "env.id")


def find_runs(path: str | Path) -> list:
    """Run dirs (dirs with a logs.csv, or a kept run's logs.csv.gz) at or under path, in natural
    order (job 2 before 10)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    found = {p.parent for name in (LOGS, KEPT_LOGS) for p in _files_under(path, name)}
    return sorted(found, key=lambda p: natural_key(str(p.relative_to(path))))


def _files_under(path: Path, name: str) -> list:
    """Files called name at or under path, but for wandb's copies and a report's kept runs (a
    report under a sweep keeps copies of its runs there) unless path is in those copies itself."""
    found = []
    for file in path.rglob(name):
        between = file.relative_to(path).parents  # dirs from file's up to path, path's own last
        if "wandb" not in file.relative_to(path).parts and not any(
            (path / d / KEPT_MARKER).exists() for d in list(between)[:-1]
        ):
            found.append(file)
    return found


# A test-mode run dir (mode=test) links to the run it played (logs.metrics.TRAINED_RUN_LINK); its
# eval.csv measures that run.
KEPT_TESTS = "tests"  # in a run's copy (copy_run): KEPT_TESTS/N/eval.csv, the tests that played it


def find_tested(path: str | Path) -> dict:
    """Test-mode results at or under path: {the trained run's dir (resolved): [test dirs]}."""
    found = {}
    for csv_path in sorted(_files_under(Path(path), "eval.csv")):
        trained = _trained_run(csv_path.parent)
        if trained is not None:
            found.setdefault(trained, []).append(csv_path.parent)
    return found


def _trained_run(test_dir: Path) -> Optional[Path]:
    """The run a test dir played: its link's target, or for a kept copy the run it is kept in."""
    link = test_dir / TRAINED_RUN_LINK
    if link.exists():
        trained = link.resolve()
    elif test_dir.parent.name == KEPT_TESTS:
        trained = test_dir.parent.parent.resolve()
    else:
        return None
    return trained if logs_file(trained) is not None else None


# What a report reads of a run, which copy_run keeps: its config, its evaluations, of Hydra's own
# config the group choices, and of logs.csv only the columns read (about a tenth of a Pong run's
# whole log, which is megabytes).
REPORT_FILES = (".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml", "eval.csv")
REPORT_COLUMNS = ("step", "time_s", "episode_returns")


KEPT_MARKER = ".kept_runs"  # in a dir of copies made by copy_run: searches from above skip it


def copy_run(run_dir: str | Path, dest: str | Path, tests: Iterable[str | Path] = ()) -> None:
    """Copies what a report reads of a run to dest, so that the report can be drawn again from the
    copy alone; tests: mode=test dirs that played it, whose evaluations go along (dest/tests/N)."""
    run_dir, dest = Path(run_dir), Path(dest)
    for name in REPORT_FILES:
        if (run_dir / name).exists():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            copy = write_hydra_choices if name.endswith("hydra.yaml") else shutil.copyfile
            copy(run_dir / name, dest / name)
    write_report_columns(logs_file(run_dir), dest / KEPT_LOGS)
    for i, test_dir in enumerate(tests):  # no link back to the copy: a cycle that site builders follow
        kept = dest / KEPT_TESTS / str(i)
        kept.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(test_dir) / "eval.csv", kept / "eval.csv")


def write_hydra_choices(hydra_yaml: Path, dest: Path) -> None:
    """Of Hydra's own config (.hydra/hydra.yaml, ~8 kB) only what a report reads, the config group
    choices (read_config), to dest, which may be hydra_yaml itself: a kept run's at ~1/20 its size."""
    hydra = (yaml.safe_load(hydra_yaml.read_text()) or {}).get("hydra") or {}
    choices = (hydra.get("runtime") or {}).get("choices") or {}
    dest.write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}, sort_keys=False))


def write_report_columns(logs: Path, dest: Path) -> None:
    """logs.csv's REPORT_COLUMNS (complete rows) to dest, which may be logs itself, gzipped where
    its name ends in .gz: a kept run's logs at a fraction of their size."""
    with open_csv(logs) as f:
        rows = csv.DictReader(f)
        columns = [c for c in REPORT_COLUMNS if c in (rows.fieldnames or ())]
        # A torn last row (the run still writing it) ends the copy.
        kept = list(itertools.takewhile(lambda row: None not in row.values() and None not in row, rows))
    for row in kept:
        if "episode_returns" in row:
            row["episode_returns"] = shortest_float32(row["episode_returns"])
    with open_csv(dest, "w") as out:
        writer = csv.DictWriter(out, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept)


def shortest_float32(returns: str) -> str:
    """A logged list of episode returns with each written as the shortest text of its float32 value:
    the rollouts sum rewards in float32, and logs.csv writes that sum as a float64's 17 digits
    (0.3826562464237213 for 0.38265625): read back as float32, each is the same value, and short
    episodes' logs halve."""
    values = json.loads(returns) if returns.strip() else []
    return json.dumps([float(str(np.float32(v))) for v in values])


KEPT_RUNS = "runs"  # under a report's dir, with --keep-runs: the copies it was drawn from


def keep_runs(loaded: list, kept: Path) -> Path:
    """Copies what the report reads of each run under kept (named as in the report), replacing an
    earlier copy; a report drawn from kept runs (all of them under kept) keeps them as they are.
    Drawn from its kept runs and new ones (a seed finished since, in another session), the kept
    ones stay and the new ones are added beside them."""
    kept = kept.resolve()
    old = [r for r in loaded if r.dir.is_relative_to(kept)]
    new = [r for r in loaded if not r.dir.is_relative_to(kept)]
    if not new:
        return kept
    if old:
        _check_additions(old, new, kept)
    else:
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir(parents=True)
        (kept / KEPT_MARKER).write_text("copies of runs that a report was drawn from (report --keep-runs)\n")
    for run in new:
        name = Path(run.name)
        copy_run(run.dir, kept / (name.relative_to(name.anchor) if name.is_absolute() else name), run.tests)
    return kept


def _check_additions(old: list, new: list, kept: Path) -> None:
    """New runs go beside a report's kept ones only if all of those were drawn from too (the report
    shows them all) and no new one takes a kept one's name."""
    drawn = {r.dir for r in old}
    left_out = [d for d in find_runs(kept) if d.resolve() not in drawn]
    if left_out:
        raise ValueError(
            f"{kept} keeps runs this report does not read ({left_out[0].relative_to(kept)}): give the kept "
            "runs dir itself beside the new runs, or --out elsewhere"
        )
    taken = {r.name for r in old} & {r.name for r in new}
    if taken:
        raise ValueError(f"a run named {sorted(taken)[0]} is kept already in {kept}: rename the new run's dir")


def read_overrides(run_dir: str | Path) -> dict:
    """The run's command-line overrides ({key: value as typed}) from .hydra/overrides.yaml."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    out = {}
    for override in yaml.safe_load(path.read_text()) or []:
        if "=" not in override or override.startswith("~"):
            continue  # a deletion changes no value that a column could hold
        key, value = override.split("=", 1)
        out[key.lstrip("+")] = value
    return out


def read_config(run_dir: str | Path) -> dict:
    """The run's composed config flattened to dotted keys (`optim.learning_rate`), and its config
    group choices (`env: pong`, from .hydra/hydra.yaml)."""
    hydra_dir = Path(run_dir) / ".hydra"
    flat = {}
    if (hydra_dir / "config.yaml").exists():
        _flatten(yaml.safe_load((hydra_dir / "config.yaml").read_text()) or {}, "", flat)
    if (hydra_dir / "hydra.yaml").exists():
        runtime = ((yaml.safe_load((hydra_dir / "hydra.yaml").read_text()) or {}).get("hydra") or {}).get("runtime")
        choices = (runtime or {}).get("choices") or {}
        flat.update({group: choice for group, choice in choices.items() if not group.startswith("hydra/")})
    return flat


def _flatten(node: dict, prefix: str, out: dict) -> None:
    for key, value in node.items():
        if isinstance(value, dict) and value:
            _flatten(value, f"{prefix}{key}.", out)
        else:
            out[f"{prefix}{key}"] = value


def read_seed(run_dir: str | Path) -> Optional[int]:
    """The seed the run used: from its composed config, else its overrides."""
    config = Path(run_dir) / ".hydra" / "config.yaml"
    if config.exists():
        seed = (yaml.safe_load(config.read_text()) or {}).get(SEED)
        if seed is not None:
            return int(seed)
    seed = read_overrides(run_dir).get(SEED)
    return int(seed) if seed is not None else None


def episode_returns(df: pd.DataFrame) -> list:
    """The episode returns of one run's rows, in order."""
    return [value for returns in df["episode_returns"] for value in returns]


def load_eval(run_dir: str | Path) -> Optional[pd.DataFrame]:
    """The run's evaluations (eval.csv: step, mean_return, ... and the protocol), by step; None if
    it has none."""
    path = Path(run_dir) / "eval.csv"
    rows = read_rows(path) if path.exists() and path.stat().st_size > 0 else []
    if not rows:  # none, or only the header: no evaluation has finished yet
        return None
    df = pd.DataFrame(rows).fillna(np.nan).dropna(subset=["step", "mean_return"])
    return df.sort_values("step", kind="stable").reset_index(drop=True) if len(df) else None


def load_run(run_dir: str | Path, name: Optional[str] = None, window: int = 100) -> pd.DataFrame:
    """One run's logs.csv with its overrides, seed and recent_return columns."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir)  # a run just started holds the header only: its columns, no rows
    df = pd.DataFrame(rows or None, columns=None if rows else CSV_FIELDS).fillna(np.nan)  # blank cells: NaN
    df[RETURN] = pd.array(recent_means(df["episode_returns"], window), dtype="Float64").astype(float)
    df.insert(0, "run", name if name is not None else run_dir.name)
    # One column per override key; a key that clashes with a logged field gets an `override.`.
    columns = {
        key: f"override.{key}" if key in df.columns or key == "setting" else key
        for key in read_overrides(run_dir)
        if key != SEED
    }
    for key, value in read_overrides(run_dir).items():
        if key in columns:
            df[columns[key]] = value
    seed = read_seed(run_dir)
    df[SEED] = seed if seed is not None else np.nan
    df.attrs["override_keys"] = list(columns.values())
    return df


# The one loader.


@dataclass
class Run:
    dir: Path
    name: str
    task: str
    seed: Optional[int]
    config: dict
    train: pd.DataFrame  # load_run: logs.csv rows with recent_return
    evals: Optional[pd.DataFrame]  # load_eval: eval.csv rows, or None
    setting: str = ALL_RUNS
    tests: list = field(default_factory=list)  # mode=test dirs that played it (evals has theirs)


def _run_name(run_dir: Path, given: list) -> str:
    """A run's name in a report: its path relative to what was given (their common dir), or its own
    dir's name when it is what was given."""
    base = given[0] if len(given) == 1 else Path(os.path.commonpath(given))
    if run_dir == base:
        return run_dir.name
    return str(run_dir.relative_to(base) if run_dir.is_relative_to(base) else run_dir)


def load(paths: str | Path | Iterable[str | Path], window: int = 100) -> list[Run]:
    """Every run at or under paths (run dirs and/or multirun dirs), and every run that a mode=test
    dir there played, once each: named relative to what was given, with its config, seed, task,
    setting (per task: assign_settings), logs.csv rows and evaluations. The one loader: the
    report reads these, load_runs puts their rows in one DataFrame."""
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not paths:
        raise FileNotFoundError("no runs dir given")
    found, tested = {}, {}
    for path in paths:
        dirs = find_runs(path)
        tested.update(find_tested(path))  # mode=test's evaluations, of runs here or elsewhere
        if not dirs and not tested:
            raise FileNotFoundError(f"no runs (no logs.csv) under {path}")
        found.update({d.resolve(): d for d in dirs})  # a run given twice counts once
    found.update({trained: trained for trained in tested if trained not in found})
    # A report's kept runs given beside new ones (keep_runs adds these to them): each kept run keeps
    # its name; the new ones are named relative to what else was given.
    given = [p.resolve() for p in paths]
    kept_roots = [p for p in given if (p / KEPT_MARKER).exists()]
    others = [p for p in given if p not in kept_roots]
    loaded = []
    for resolved in found:
        root = next((k for k in kept_roots if resolved.is_relative_to(k)), None) if others else None
        name = _run_name(resolved, [root] if root is not None else others or given)
        config = {**read_overrides(resolved), **read_config(resolved)}
        loaded.append(
            Run(
                dir=resolved,
                name=name,
                task=str(config.get("env.id") or config.get("env") or "unknown task"),
                seed=read_seed(resolved),
                config=config,
                train=load_run(resolved, name=name, window=window),
                evals=_evaluations(resolved, tested.get(resolved, [])),
                tests=tested.get(resolved, []),
            )
        )
    assign_settings(loaded)
    return loaded


def _evaluations(run_dir: Path, test_dirs: list) -> Optional[pd.DataFrame]:
    """A run's evaluations: during training (its eval.csv) and by mode=test (theirs), by step."""
    frames = [df for df in (load_eval(d) for d in [run_dir, *test_dirs]) if df is not None]
    if not frames:
        return None
    return pd.concat(frames, ignore_index=True).sort_values("step", kind="stable").reset_index(drop=True)


# A population's members are one setting, as seeds are: their curves pool (populations.py).
POPULATION_KEYS = ("pbt.member",)


def assign_settings(loaded: list) -> None:
    """Per task, the keys whose values differ between its runs (less the seed, the task's own keys
    and sweep_record.RUN_CONTROL_KEYS) label each run's setting, e.g. `optim.learning_rate=0.001`."""
    for task in task_names(loaded):
        group = [r for r in loaded if r.task == task]
        configs, typed = comparable_configs(group, [set(read_overrides(r.dir)) for r in group])
        keys = [
            k
            for k in differing_keys(configs, typed=typed)
            if k != SEED and k not in TASK_KEYS and not is_run_control(k) and k not in POPULATION_KEYS
        ]
        for run, config in zip(group, configs):
            label = ",".join(f"{k}={config[k]}" for k in keys if config.get(k) is not None)
            run.setting = label or ALL_RUNS


def task_names(loaded: list) -> list:
    return sorted({r.task for r in loaded}, key=natural_key)


def setting_names(loaded: list) -> list:
    return sorted({r.setting for r in loaded}, key=natural_key)


def load_runs(paths: str | Path | Iterable[str | Path], window: int = 100) -> pd.DataFrame:
    """Every run at or under paths (run dirs and/or multirun dirs) in one DataFrame: load's runs'
    logs.csv rows.

    Adds a column per swept key (its value in each run's config), and `setting`: the swept keys
    other than the seed, across all the runs (the report's settings are per task). attrs: `swept`
    (every key whose value differs between the runs, the seed included), `swept_keys` (the
    setting's keys), `override_keys`, `window`.
    """
    loaded = load(paths, window)
    frames = [run.train for run in loaded]
    configs, typed = comparable_configs(loaded, [set(f.attrs["override_keys"]) for f in frames])
    swept = [k for k in differing_keys(configs, typed=typed) if not is_run_control(k)]
    setting_keys = [k for k in swept if k != SEED]
    # A column per swept key, with its value in each run (defaults included); a key that clashes
    # with a logged field gets an `override.`, as in load_run.
    columns = [
        f"override.{k}" if k in frames[0].columns and k not in frames[0].attrs["override_keys"] else k
        for k in setting_keys
    ]
    for frame, config in zip(frames, configs):
        for key, column in zip(setting_keys, columns):
            frame[column] = _text(config.get(key))
    keys = list(dict.fromkeys(k for f in frames for k in f.attrs["override_keys"]))
    df = pd.concat(frames, ignore_index=True)
    if setting_keys:
        labels = df[columns].fillna("").astype(str)
        df["setting"] = [
            ",".join(f"{k}={v}" for k, v in zip(setting_keys, row) if v != "") for row in labels.itertuples(index=False)
        ]
    else:
        df["setting"] = ALL_RUNS
    df.attrs.update(override_keys=keys, swept=swept, swept_keys=setting_keys, window=window)
    return df


def comparable_configs(loaded: list, typed_by_run: list) -> tuple[list, set]:
    """Each run's flattened config with its seed and the keys the code gained since (with_gained_keys),
    and every key any run typed: what differing_keys compares."""
    configs = with_gained_keys([{**run.config, SEED: run.seed} for run in loaded], typed_by_run)
    return configs, set().union(*typed_by_run)


def with_gained_keys(configs: list, typed_by_run: list) -> list:
    """The configs, each given the keys the code gained after it ran, at their default: the value
    every run that has the key and did not type it shares. A run that predates a key ran as its
    default does (a new option's default keeps the old behaviour), so it belongs with the runs that
    left the key alone, not in a setting of its own. A key whose untyped runs disagree (the default
    changed) is left missing."""
    keys = list(dict.fromkeys(k for config in configs for k in config))
    defaults = {}
    for key in keys:
        untyped = {_text(c[key]): c[key] for c, typed in zip(configs, typed_by_run) if key in c and key not in typed}
        if len(untyped) == 1 and any(key not in c for c in configs):
            defaults[key] = next(iter(untyped.values()))
    return [{**{k: v for k, v in defaults.items() if k not in c}, **c} for c in configs]


def differing_keys(configs: list, typed: Iterable[str] = ()) -> list:
    """Keys whose values differ between the runs' flattened configs.

    A key some runs lack is a difference only where a command line typed it (typed: the override
    keys): one that no run typed and all that have it share is a key the code gained between the
    runs (an older run predates it), not a setting. A config group whose choice differs (`env`)
    stands for the keys under it (`env.id`, ...), unless one of those was typed.
    """
    typed = set(typed)
    keys = list(dict.fromkeys(k for config in configs for k in config))
    differ = [k for k in keys if _differs(k, configs, typed)]
    groups = [k for k in differ if any(other.startswith(f"{k}.") for other in keys)]
    return [k for k in differ if k in typed or not any(k.startswith(f"{g}.") for g in groups)]


def _differs(key: str, configs: list, typed: set) -> bool:
    values = {_text(config[key]) for config in configs if key in config}
    return len(values) > 1 or (key in typed and any(key not in config for config in configs))


def _text(value) -> str:
    return "" if value is None else str(value)


def loss_columns(df: pd.DataFrame) -> list:
    """The loss columns logged: total_loss first, then each named loss term (`*_loss`)."""
    terms = sorted(c for c in df.columns if c.endswith("_loss") and c != "total_loss")
    return ["total_loss", *terms] if "total_loss" in df.columns else terms


def swept_keys(df: pd.DataFrame) -> list:
    """The swept keys that make a setting (the seed excluded), as load_runs found them."""
    return list(df.attrs.get("swept_keys", []))


def settings(df: pd.DataFrame) -> list:
    """The settings in a stable order: numbers by value, then text."""
    return sorted(df["setting"].unique(), key=natural_key)


def final_returns(df: pd.DataFrame, last_n: int = 100) -> pd.DataFrame:
    """Per run: the mean return of its last `last_n` episodes, its episodes and steps."""
    rows = []
    for run, run_df in df.groupby("run", sort=False):
        returns = episode_returns(run_df)[-last_n:]
        rows.append(
            dict(
                run=run,
                setting=run_df["setting"].iloc[0],
                seed=run_df[SEED].iloc[0],
                steps=int(run_df["step"].max()),
                episodes=len(episode_returns(run_df)),
                final_return=float(np.mean(returns)) if returns else np.nan,
            )
        )
    return pd.DataFrame(rows, columns=["run", "setting", "seed", "steps", "episodes", "final_return"])


def final_returns_by_setting(df: pd.DataFrame, last_n: int = 100) -> pd.DataFrame:
    """Per setting: final return mean, std (across seeds; NaN for one), min, max, and runs."""
    per_run = final_returns(df, last_n)
    table = per_run.groupby("setting")["final_return"].agg(["mean", "std", "min", "max", "count"])
    table = table.rename(columns={"count": "runs"}).reindex(settings(df))
    table.index.name = "setting"
    return table


def learning_curve(df: pd.DataFrame, metric: str, bins: int = 100) -> pd.DataFrame:
    """A metric against steps, per setting: mean and std across that setting's runs.

    Each run is averaged within `bins` equal step intervals over the setting's range (so runs
    whose rows fall at different steps line up), then the runs are combined per interval.
    Returns columns setting, step (the interval's end), mean, std, runs.
    """
    out = []
    for setting in settings(df):
        part = df[df["setting"] == setting].dropna(subset=[metric])
        if part.empty:
            continue
        top = float(part["step"].max())
        edges = np.linspace(0.0, top, max(1, min(bins, part.groupby("run").size().max())) + 1)
        index = np.clip(np.searchsorted(edges, part["step"].to_numpy(float), side="left") - 1, 0, len(edges) - 2)
        per_run = part.assign(_bin=index).groupby(["run", "_bin"])[metric].mean().unstack("run")
        out.append(
            pd.DataFrame(
                dict(
                    setting=setting,
                    step=edges[per_run.index + 1],
                    mean=per_run.mean(axis=1).to_numpy(),
                    std=per_run.std(axis=1).fillna(0.0).to_numpy(),
                    runs=per_run.count(axis=1).to_numpy(),
                )
            )
        )
    if not out:
        return pd.DataFrame(columns=["setting", "step", "mean", "std", "runs"])
    return pd.concat(out, ignore_index=True)


def latest_runs_dir(root: Optional[str | Path] = None) -> Path:
    """The newest run or sweep under outputs/ (./outputs, else ../outputs): a sweep dir when its
    jobs are the newest runs, else a run dir."""
    roots = [Path(root)] if root is not None else [Path("outputs"), Path("..") / "outputs"]
    for base in roots:
        if not base.is_dir():
            continue
        newest, when = None, -1.0
        for run_dir in find_runs(base):
            unit = run_dir.parent if (run_dir.parent / "multirun.yaml").exists() else run_dir
            mtime = logs_file(run_dir).stat().st_mtime
            if mtime > when:
                newest, when = unit, mtime
        if newest is not None:
            return newest
    raise FileNotFoundError(f"no runs under {' or '.join(map(str, roots))}: set RUNS_DIR")


def natural_key(text: str):
    return [
        (0, float(part), "") if re.fullmatch(r"\d+(\.\d+)?(e-?\d+)?", part) else (1, 0.0, part)
        for part in re.split(r"(\d+(?:\.\d+)?(?:e-?\d+)?)", str(text))
        if part
    ]
