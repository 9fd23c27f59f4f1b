"""The `pbt` group (conf/pbt/): population-based training's schema and checks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from torchbeast_hydra.errors import ConfigError, require
from torchbeast_hydra.learning.learner import LIVE_KEYS


class PbtObjective(enum.Enum):
    """What ranks the members."""

    # The mean return of the training episodes that ended since the member's last publish (its last
    # 100 at most): free, and measured on the policy being trained.
    train = "train"
    # The newest evaluation's mean return (eval.interval_steps), of weights taken since the member's
    # last publish: a member waits for one before it publishes.
    eval = "eval"


class PbtStart(enum.Enum):
    """The hyperparameters the members start with (a key's own `start` list comes first)."""

    config = "config"  # the config's values, the same in every member
    resample = "resample"  # each member draws its own from the key's range or choices (seeded by seed and member)


@dataclass
class KeyMutation:
    """How one hyperparameter mutates (explore). Perturbed: times one of `factors` (at random), kept
    in [low, high]; resampled (pbt.resample_probability): drawn afresh from [low, high] (log-uniformly
    with log) or from `choices`."""

    reference_prefix = "pbt.mutate.GROUP.KEY."  # where its keys sit (the configuration reference's rows)

    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = True  # resample log-uniformly: rates and costs span decades
    factors: List[float] = field(default_factory=lambda: [0.8, 1.25])
    # A list of values instead of a range: perturbing moves to a neighbouring value, resampling draws one.
    choices: Optional[List[float]] = None
    # The values members start with: member i takes start[i % len(start)], over pbt.start.
    start: Optional[List[float]] = None


@dataclass
class PbtConfig:
    """Population-based training (torchbeast_hydra/pbt/, docs/pbt.md): `-m pbt=default` runs
    pbt.population members as the jobs of one multirun; every interval_steps each publishes its score
    and checkpoint to the population's dir, and one in the bottom fraction copies a top member's
    latest checkpoint (weights, optimiser state, normalisation statistics) and mutates its values."""

    population: int = 0  # members; 0: no population-based training
    member: int = 0  # this job's member, 0..population-1 (pbt=default sweeps it)
    # The population's dir; null: SWEEP_DIR/pbt (SWEEP_DIR/pbt/<the job's other swept overrides> when
    # the multirun sweeps more than pbt.member, e.g. seed=1,2: one population per seed).
    dir: Optional[str] = None
    interval_steps: int = 50_000  # agent steps between a member's publishes (and exploit decisions)
    objective: PbtObjective = PbtObjective.train
    bottom_fraction: float = 0.25  # the members that exploit: the worst this fraction of those published
    top_fraction: float = 0.25  # the members they copy from: the best this fraction
    # false: members never copy nor mutate; each keeps its starting values (with pbt.start=resample,
    # a random search over the same ranges: the baseline benchmarks/pbt.py compares against).
    exploit: bool = True
    resample_probability: float = 0.25  # per key, at an exploit: resample rather than perturb
    start: PbtStart = PbtStart.config
    # The keys that mutate: group -> key -> KeyMutation, e.g. mutate.optim.learning_rate: {low: 1e-4,
    # high: 1e-2}. Only keys an update reads afresh can (learning.learner.LIVE_KEYS).
    mutate: Dict[str, Any] = field(default_factory=dict)


MUTATION_FIELDS = {f.name for f in fields(KeyMutation)}


def mutations(pbt) -> dict:
    """pbt.mutate as dotted key -> KeyMutation (a typed config); raises ConfigError for a key that
    cannot change during a run or a spec that is not a KeyMutation."""
    found = {}
    _collect(OmegaConf.to_container(pbt.mutate) if OmegaConf.is_config(pbt.mutate) else pbt.mutate, "", found)
    specs = {}
    for key, spec in found.items():
        if key not in LIVE_KEYS:
            raise ConfigError(
                f"pbt.mutate.{key}: {key} cannot change during a run (it shapes the model, the env, the batch or "
                f"the optimiser's state); keys that can mutate: {', '.join(LIVE_KEYS)}."
            )
        try:
            specs[key] = OmegaConf.merge(OmegaConf.structured(KeyMutation), spec)
        except Exception as error:
            fields_ = ", ".join(sorted(MUTATION_FIELDS))
            raise ConfigError(f"pbt.mutate.{key}: {str(error).splitlines()[0]} (fields: {fields_}).") from None
    return specs


def _collect(node, prefix: str, found: dict) -> None:
    """The specs under node: a dict with any of KeyMutation's fields is one; others are groups."""
    if not isinstance(node, dict) or not node:
        raise ConfigError(f"pbt.mutate.{prefix.rstrip('.')}: give {{low: ..., high: ...}} or {{choices: [...]}}.")
    if MUTATION_FIELDS & set(node):
        found[prefix.rstrip(".")] = node
        return
    for key, value in node.items():
        _collect(value, f"{prefix}{key}.", found)


def check(cfg) -> None:
    """The pbt slice's checks (nothing to check with population=0)."""
    pbt = cfg.pbt
    if pbt.population == 0:
        return
    require(pbt.population >= 2, f"pbt.population={pbt.population}: a population needs 2 members or more (0: off).")
    require(
        0 <= pbt.member < pbt.population,
        f"pbt.member={pbt.member} must be in 0..{pbt.population - 1} (pbt=default sweeps it over the population).",
    )
    require(pbt.interval_steps > 0, "pbt.interval_steps must be positive.")
    for key in ("bottom_fraction", "top_fraction"):
        require(0 < pbt[key] <= 0.5, f"pbt.{key}={pbt[key]} must be in (0, 0.5].")
    require(0 <= pbt.resample_probability <= 1, "pbt.resample_probability must be in [0, 1].")
    require(
        cfg.distributed.nproc == 1,
        "population-based training runs one rank per member: set distributed.nproc=1 (or pbt=none).",
    )
    if PbtObjective(pbt.objective) is PbtObjective.eval:
        require(
            0 < cfg.eval.interval_steps <= pbt.interval_steps,
            f"pbt.objective=eval ranks members by evaluations: set eval.interval_steps to at most "
            f"pbt.interval_steps={pbt.interval_steps} (it is {cfg.eval.interval_steps}), or pbt.objective=train.",
        )
    for key, spec in mutations(pbt).items():
        _check_mutation(cfg, key, spec, pbt.population)


def _check_mutation(cfg, key: str, spec, population: int) -> None:
    where = f"pbt.mutate.{key}"
    current = OmegaConf.select(cfg, key)
    require(current is not None, f"{where}: {key} is null (off) in this config; give it a value to mutate it.")
    if spec.choices is not None:
        require(len(spec.choices) >= 2, f"{where}.choices needs 2 values or more.")
    else:
        require(
            spec.low is not None and spec.high is not None and spec.low < spec.high,
            f"{where}: give low < high (e.g. {{low: {current / 10:g}, high: {current * 10:g}}}) or choices.",
        )
        require(not spec.log or spec.low > 0, f"{where}.low must be positive with log: true (log-uniform).")
    require(len(spec.factors) >= 1 and all(f > 0 for f in spec.factors), f"{where}.factors must be positive numbers.")
    for value in spec.start or []:
        inside = value in spec.choices if spec.choices is not None else spec.low <= value <= spec.high
        require(inside, f"{where}.start: {value} is outside its range (low/high or choices).")
