"""Explore: a member's new hyperparameters, perturbed or resampled within each key's bounds.

Pure functions of a random.Random that the caller seeds, so a member's draws follow from the run's
seed, its member number and the step (the same after a resume).
"""

from __future__ import annotations

import math
import random


def clip(spec, value: float) -> float:
    """value kept within the key's range (or its nearest choice)."""
    if spec.choices is not None:
        return min(spec.choices, key=lambda choice: abs(choice - value))
    return min(max(value, spec.low), spec.high)


def resample(spec, rng: random.Random) -> float:
    """A fresh value: one of the choices, or uniform (log-uniform with log) in [low, high]."""
    if spec.choices is not None:
        return rng.choice(list(spec.choices))
    if spec.log:
        return math.exp(rng.uniform(math.log(spec.low), math.log(spec.high)))
    return rng.uniform(spec.low, spec.high)


def perturb(spec, value: float, rng: random.Random) -> float:
    """value times one of the factors, within bounds; with choices, a step to a neighbouring choice
    (the factor's direction: below 1 down, above 1 up)."""
    factor = rng.choice(list(spec.factors))
    if spec.choices is None:
        return clip(spec, value * factor)
    ordered = sorted(spec.choices)
    here = ordered.index(clip(spec, value))
    step = -1 if factor < 1 else 1 if factor > 1 else 0
    return ordered[min(max(here + step, 0), len(ordered) - 1)]


def explore(specs: dict, values: dict, resample_probability: float, rng: random.Random) -> dict:
    """New values for every key of specs (dotted key -> KeyMutation), from values (the copied
    member's): each resampled with resample_probability, else perturbed."""
    return {
        key: resample(spec, rng) if rng.random() < resample_probability else perturb(spec, values[key], rng)
        for key, spec in specs.items()
    }


def start_values(specs: dict, configured: dict, member: int, resample_all: bool, rng: random.Random) -> dict:
    """A member's first values: the key's start list (member i takes start[i % len]), else resampled
    (pbt.start=resample), else the config's value (configured)."""
    values = {}
    for key, spec in specs.items():
        if spec.start:
            values[key] = float(spec.start[member % len(spec.start)])
        elif resample_all:
            values[key] = resample(spec, rng)
        else:
            values[key] = configured[key]
    return values
