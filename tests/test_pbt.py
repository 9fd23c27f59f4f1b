"""Population-based training: mutation within bounds, refusal of keys that cannot change live, the
learner taking new values live, the population's dir under racing members, and (slow) populations
that train: one member rescued by exploit, a member killed and resumed, mode=test on the population."""

from __future__ import annotations

import math
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from omegaconf import OmegaConf
from test_learner import learner_batch, learner_cfg, make_learner, params_of

from torchbeast_hydra.config import validate
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.learning.learner import LIVE_KEYS
from torchbeast_hydra.pbt import mutation, population
from torchbeast_hydra.pbt.settings import KeyMutation, mutations
from torchbeast_hydra.run import checkpoint

from helpers import REPO, SMALL, compose_config, run_cli, run_sweep, start_cli, wait_for


def spec(**fields):
    return OmegaConf.merge(OmegaConf.structured(KeyMutation), fields)


# -- explore ------------------------------------------------------------------------------------------


def test_perturbing_and_resampling_stay_within_bounds():
    rng = random.Random(0)
    rate = spec(low=1e-4, high=1e-2, factors=[0.5, 2.0])
    value, seen = 5e-3, set()
    for _ in range(500):
        value = mutation.perturb(rate, value, rng)
        assert 1e-4 <= value <= 1e-2
        seen.add(value)
    assert 1e-4 in seen and 1e-2 in seen  # the walk reached both bounds and stayed there, clipped
    draws = [mutation.resample(rate, rng) for _ in range(2000)]
    assert all(1e-4 <= d <= 1e-2 for d in draws)
    # Log-uniform: as many draws in each decade.
    below = sum(d < 1e-3 for d in draws)
    assert 850 < below < 1150
    linear = spec(low=0.9, high=0.999, log=False)
    assert all(0.9 <= mutation.resample(linear, rng) <= 0.999 for _ in range(200))


def test_choices_move_to_a_neighbour_or_resample_among_them():
    rng = random.Random(1)
    gamma = spec(choices=[0.95, 0.99, 0.997], factors=[0.8, 1.25])
    for _ in range(100):
        assert mutation.perturb(gamma, 0.99, rng) in (0.95, 0.997)
        assert mutation.perturb(gamma, 0.997, rng) in (0.99, 0.997)
        assert mutation.resample(gamma, rng) in (0.95, 0.99, 0.997)


def test_explore_resamples_with_its_probability_else_perturbs():
    specs = {"optim.learning_rate": spec(low=1e-5, high=1.0, factors=[0.8, 1.25])}
    rng = random.Random(2)
    start = {"optim.learning_rate": 0.01}
    perturbed = [mutation.explore(specs, start, 0.0, rng)["optim.learning_rate"] for _ in range(50)]
    assert {round(v, 10) for v in perturbed} == {0.008, 0.0125}
    resampled = [mutation.explore(specs, start, 1.0, rng)["optim.learning_rate"] for _ in range(50)]
    assert len(set(resampled)) == 50


def test_start_values_take_the_members_entry_of_a_start_list_else_resample_or_the_config():
    specs = {
        "optim.learning_rate": spec(low=1e-7, high=1e-2, start=[3e-3, 1e-7]),
        "vtrace.entropy_cost": spec(low=1e-4, high=0.1),
    }
    configured = {"optim.learning_rate": 1e-3, "vtrace.entropy_cost": 0.01}
    for member, lr in [(0, 3e-3), (1, 1e-7), (2, 3e-3)]:
        values = mutation.start_values(specs, configured, member, False, random.Random(0))
        assert values == {"optim.learning_rate": lr, "vtrace.entropy_cost": 0.01}
    drawn = mutation.start_values(specs, configured, 1, True, random.Random(0))
    assert drawn["optim.learning_rate"] == 1e-7 and drawn["vtrace.entropy_cost"] != 0.01


# -- the config ---------------------------------------------------------------------------------------

POPULATION = ["experiment=cartpole", "pbt=default"]


def test_the_default_preset_sweeps_one_job_per_member():
    from hydra import compose, initialize_config_dir

    from torchbeast_hydra.__main__ import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        whole = compose(config_name="config", overrides=[*POPULATION, "pbt.population=6"], return_hydra_config=True)
    assert whole.hydra.sweeper.params["pbt.member"] == "range(0,6)"
    checked = validate(compose_config([*POPULATION, "pbt.population=6"]))
    assert set(mutations(checked.pbt)) == {"optim.learning_rate", "vtrace.entropy_cost"}


@pytest.mark.parametrize(
    "override, named",
    [
        ("+pbt.mutate.model.hidden_size={low:32,high:256}", "pbt.mutate.model.hidden_size: model.hidden_size cannot"),
        ("+pbt.mutate.batch_size={low:8,high:32}", "pbt.mutate.batch_size: batch_size cannot change"),
        ("+pbt.mutate.env.id={choices:[1,2]}", "pbt.mutate.env.id: env.id cannot change"),
        ("+pbt.mutate.optim.alpha={low:0.9,high:0.99}", "pbt.mutate.optim.alpha: optim.alpha cannot change"),
    ],
)
def test_a_key_that_cannot_change_during_a_run_is_refused_by_name(override, named):
    with pytest.raises(ConfigError, match="cannot change during a run") as error:
        validate(compose_config([*POPULATION, override]))
    assert str(error.value).startswith(named)
    assert "optim.learning_rate" in str(error.value)  # and it says which keys can


@pytest.mark.parametrize(
    "override, message",
    [
        ("pbt.population=1", "needs 2 members"),
        ("pbt.member=4", "pbt.member=4 must be in 0..3"),
        ("pbt.mutate.optim.learning_rate.low=0.1", "give low < high"),
        ("pbt.mutate.optim.learning_rate.start=[1.0]", "outside its range"),
        ("pbt.objective=eval", "set eval.interval_steps to at most"),
        ("+pbt.mutate.vtrace.ppo_clip={low:0.1,high:0.3}", "vtrace.ppo_clip is null"),
        ("pbt.bottom_fraction=0.8", "pbt.bottom_fraction=0.8 must be in (0, 0.5]"),
    ],
)
def test_bad_population_settings_say_what_to_change(override, message):
    overrides = [*POPULATION, override]
    if override == "pbt.objective=eval":
        overrides.append("eval.interval_steps=100000")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        validate(compose_config(overrides))


def test_the_presets_hold_only_what_differs_from_the_schema():
    from torchbeast_hydra.__main__ import CONFIG_DIR
    from torchbeast_hydra.pbt.settings import PbtConfig

    preset = OmegaConf.load(f"{CONFIG_DIR}/pbt/default.yaml").pbt
    default = PbtConfig()
    assert [key for key in preset if key != "mutate" and preset[key] == getattr(default, key)] == []
    assert OmegaConf.load(f"{CONFIG_DIR}/pbt/none.yaml") in ({}, None)


def test_pbt_none_is_no_population():
    assert validate(compose_config(["experiment=cartpole"])).pbt.population == 0


# -- live hyperparameters -----------------------------------------------------------------------------


def test_every_live_key_changes_what_the_next_update_uses_and_the_runs_config_stays():
    cfg = learner_cfg()
    learner = make_learner(cfg)
    new = {
        "optim.learning_rate": 0.002,
        "optim.epsilon": 0.02,
        "optim.grad_norm_clipping": 3.0,
        "vtrace.discounting": 0.9,
        "vtrace.baseline_cost": 0.25,
        "vtrace.entropy_cost": 0.05,
        "vtrace.reward_scale": 0.1,
        "vtrace.trace_lambda": 0.95,
        "vtrace.clip_rho_threshold": 2.0,
        "vtrace.clip_pg_rho_threshold": 3.0,
        "vtrace.ppo_clip": 0.2,
    }
    assert set(new) == set(LIVE_KEYS)
    factor = learner.scheduler.lr_lambdas[0](learner.scheduler.last_epoch)
    learner.set_hyperparameters(new)
    assert learner.hyperparameters(LIVE_KEYS) == new
    group = learner.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.002 * factor) and group["eps"] == 0.02
    assert learner.scheduler.base_lrs == [0.002]  # the schedule anneals the new rate
    assert learner.loss_terms["entropy_loss"][1] == 0.05 and learner.loss_terms["baseline_loss"][1] == 0.25
    assert learner.vtrace_cfg.discounting == 0.9 and learner.vtrace_cfg.reward_scale == 0.1
    assert cfg.optim.learning_rate == 0.01 and cfg.vtrace.entropy_cost != 0.05  # the run's config: as started
    with pytest.raises(ConfigError, match="optim.alpha cannot change during a run"):
        learner.set_hyperparameters({"optim.alpha": 0.9})


def test_a_new_clipping_and_entropy_cost_change_the_next_update():
    def update_with(values):
        cfg = learner_cfg()
        learner = make_learner(cfg)
        learner.set_hyperparameters(values)
        before = [p.clone() for p in params_of(learner)]
        stats = learner.update(learner_batch(cfg), ())
        moved = torch.cat([(a - b).flatten() for a, b in zip(params_of(learner), before)]).norm()
        return stats, float(moved)

    (base, moved), (_, moved_clipped) = update_with({}), update_with({"optim.grad_norm_clipping": 1e-4})
    assert moved_clipped < moved / 100
    no_entropy, _ = update_with({"vtrace.entropy_cost": 0.0})
    assert base["entropy_loss"] != 0 and no_entropy["entropy_loss"] == 0


# -- the population's dir -----------------------------------------------------------------------------


def test_the_bottom_member_copies_a_better_top_member():
    rng = random.Random(0)
    scores = {0: 10.0, 1: 50.0, 2: 30.0, 3: 90.0}
    assert population.choose_source(scores, 0, 0.25, 0.25, rng) == 3
    assert population.choose_source(scores, 2, 0.25, 0.25, rng) is None  # the middle trains on
    assert population.choose_source(scores, 3, 0.5, 0.5, rng) is None
    assert population.choose_source({0: math.nan, 1: 20.0}, 0, 0.5, 0.5, rng) == 1  # no episode yet ranks last
    assert population.choose_source({0: 5.0, 1: 5.0}, 0, 0.5, 0.5, rng) is None  # a tie: nothing to gain
    assert population.choose_source({0: 5.0}, 0, 0.5, 0.5, rng) is None  # alone


RACER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from torchbeast_hydra.pbt import population
    from torchbeast_hydra.run import checkpoint
    directory, member, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for step in range(rounds):
        weights = torch.full((5000,), float(member * 1000 + step))
        checkpoint.save(population.published_path(directory, member), dict(step=step, weights=weights))
        population.append(directory, dict(member=member, step=step, event="publish", score=step * 1.5,
                          run_dir="x" * (member * 50)), ["optim.learning_rate"])
        population.read_table(directory)
        other = (member + 1) % 4
        if population.member_dir(directory, other).exists():
            state = population.load_published(directory, other)  # whole, whatever the writer is doing
            assert (state["weights"] == state["weights"][0]).all(), "a torn checkpoint"
    """
)


def test_racing_members_leave_a_whole_table_and_whole_checkpoints(tmp_path):
    rounds = 25
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(member), str(rounds)], cwd=REPO)
        for member in range(4)
    ]
    assert [racer.wait(timeout=120) for racer in racers] == [0, 0, 0, 0]
    rows = population.read_table(tmp_path)
    assert len(rows) == 4 * rounds
    for member in range(4):
        mine = [row for row in rows if row["member"] == member]
        assert [row["step"] for row in mine] == list(range(rounds))  # each in its order, none lost or torn
        assert all((row["run_dir"] or "") == "x" * (member * 50) and row["score"] == row["step"] * 1.5 for row in mine)
        assert checkpoint.load(population.published_path(tmp_path, member))["step"] == rounds - 1
    assert population.latest_scores(rows) == {m: (rounds - 1, (rounds - 1) * 1.5) for m in range(4)}


def test_a_row_cut_short_by_a_kill_is_skipped_and_the_next_row_starts_on_its_own_line(tmp_path):
    keys = ["optim.learning_rate"]
    population.append(tmp_path, dict(member=0, step=1, event="publish", score=2.0), keys)
    with open(tmp_path / population.TABLE, "a") as table:
        table.write("123.0,1,5,publ")  # a member killed mid-row
    population.append(tmp_path, dict(member=2, step=3, event="publish", score=4.0), keys)
    assert [(row["member"], row["score"]) for row in population.read_table(tmp_path)] == [(0, 2.0), (2, 4.0)]


def test_a_table_of_another_population_is_refused(tmp_path):
    population.append(tmp_path, dict(member=0, step=1, event="start"), ["optim.learning_rate"])
    with pytest.raises(population.PopulationError, match="pbt.dir"):
        population.append(tmp_path, dict(member=1, step=1, event="start"), ["vtrace.entropy_cost"])


def test_the_best_member_is_the_best_latest_score(tmp_path):
    keys = []
    for member, step, score in [(0, 10, 90.0), (1, 10, 50.0), (0, 20, 20.0), (1, 20, 60.0), (2, 10, math.nan)]:
        population.append(tmp_path, dict(member=member, step=step, event="publish", score=score), keys)
    assert population.best_member(tmp_path)[0] == 1
    with pytest.raises(population.PopulationError, match="no published score"):
        population.best_member(tmp_path / "empty")


# -- populations that train (slow) --------------------------------------------------------------------

# Tiny CartPole members; member i starts with the learning rate start[i] (1e-7: too small to learn).
MEMBER = [
    *SMALL,
    "experiment=cartpole",
    "pbt=default",
    "eval.interval_steps=0",
    "pbt.start=config",
    "pbt.resample_probability=0",
    "pbt.mutate.optim.learning_rate.low=1e-7",
]


def test_a_population_replaces_a_member_that_cannot_learn_and_mode_test_plays_its_best(tmp_path):
    # On the basic launcher the members run in turn: member 3, whose learning rate is too small to
    # learn, finds the others' published checkpoints, copies one at its first interval, and learns.
    sweep = tmp_path / "sweep"
    result = run_sweep(
        sweep,
        *MEMBER[len(SMALL) :],  # experiment=cartpole's batches: fewer updates than SMALL's, and it learns sooner
        *SMALL[-2:],
        "pbt.population=4",
        "total_steps=40000",
        "pbt.interval_steps=10000",
        "pbt.mutate.optim.learning_rate.start=[0.003,0.003,0.003,1e-7]",
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = population.read_table(sweep / "pbt")
    mine = [row for row in rows if row["member"] == 3]
    assert mine[0]["event"] == "start" and mine[0]["optim.learning_rate"] == 1e-7
    exploit = next(row for row in mine if row["event"] == "exploit")
    assert exploit["exploited_from"] in (0, 1, 2) and exploit["step"] <= 10200
    assert 1e-4 <= exploit["optim.learning_rate"] <= 0.01  # the copied (perturbed) rate, not 1e-7
    scores = [row["score"] for row in mine if row["event"] == "publish"]
    assert scores[-1] > max(40.0, 1.5 * scores[0]), scores  # it learns after the copy (random play: ~22)
    for member in range(4):  # every member published to the end, and its checkpoint is whole
        assert [r["step"] for r in rows if r["member"] == member and r["event"] == "publish"][-1] >= 40000
        assert checkpoint.load(population.published_path(sweep / "pbt", member))["step"] >= 40000
    best, _ = population.best_member(sweep / "pbt")
    tested = run_cli(tmp_path / "test", "mode=test", f"load_dir={sweep / 'pbt'}", "test.num_episodes=2", *SMALL[-1:])
    assert f"Playing the population's best member, {best}" in tested.stdout + tested.stderr


def test_a_member_stopped_by_a_signal_resumes_with_its_copied_weights_values_and_lineage(tmp_path):
    pop = tmp_path / "population"
    member = [*MEMBER, "pbt.population=2", f"pbt.dir={pop}", "pbt.mutate.optim.learning_rate.start=[0.003,1e-7]"]
    # Member 0 trains a little and publishes; the test then says it scored 1,000 (the dir is all members share).
    run_cli(tmp_path / "m0", *member, "pbt.member=0", "total_steps=1024", "pbt.interval_steps=1024")
    population.append(pop, dict(member=0, step=1024, event="publish", score=1000.0, run_dir="../m0"),
                      ["optim.learning_rate", "vtrace.entropy_cost"])  # fmt: skip
    copied = checkpoint.load(population.published_path(pop, 0))["learner"]["model"]
    one = [*member, "pbt.member=1", "pbt.interval_steps=1024"]
    process = start_cli(tmp_path / "m1", *one, "total_steps=100000")

    def lineage():
        path = checkpoint.path_in(tmp_path / "m1")
        return path.exists() and checkpoint.load(path).get("extras", {}).get("pbt", {}).get("lineage")

    try:
        wait_for(lineage, timeout=300, what="member 1 to copy member 0 and save its checkpoint")
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output[-3000:]
    exploit = next(r for r in population.read_table(pop) if r["member"] == 1 and r["event"] == "exploit")
    assert exploit["exploited_from"] == 0 and exploit["from_step"] == 1024
    state = checkpoint.load(checkpoint.path_in(tmp_path / "m1"))
    assert state["extras"]["pbt"]["values"]["optim.learning_rate"] == exploit["optim.learning_rate"] > 1e-3
    if state["step"] == exploit["step"]:  # stopped before another update: the copied weights, as copied
        assert all(torch.equal(state["learner"]["model"][k], copied[k]) for k in copied)
    # Started again (the same command, a shorter run): its values and lineage, not the config's 1e-7.
    resumed = run_cli(tmp_path / "m1", *one, "total_steps=3072")
    assert resumed.returncode == 0
    rows = [r for r in population.read_table(pop) if r["member"] == 1]
    resume = next(r for r in rows if r["event"] == "resume")
    assert resume["optim.learning_rate"] == exploit["optim.learning_rate"]
    final = checkpoint.load(checkpoint.path_in(tmp_path / "m1"))
    assert final["step"] >= 3072 and final["extras"]["pbt"]["lineage"][0]["source"] == 0
    assert rows[-1]["event"] == "publish" and rows[-1]["step"] >= 3072


def test_a_run_outside_a_multirun_needs_its_populations_dir(tmp_path):
    result = run_cli(tmp_path / "run", *MEMBER, "total_steps=1024", check=False)
    assert result.returncode == 2
    assert "a population's members are the jobs of a multirun: add -m" in result.stdout + result.stderr
