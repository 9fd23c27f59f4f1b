"""The env families this package offers an option and an extra for, in one table: what registers
their ids, how their ids start, the model their env option brings and the default id. Config
schemas (env/settings.py), env construction's hints (env/make.py), `--help` and the docs read it.

Atari needs none of this: ale-py is a dependency and its ids are recognised by their entry point.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    option: str  # env=<option> (conf/env/<option>.yaml), also the pip extra: pip install ".[<option>]"
    module: str  # importing it registers the family's ids (env.imports)
    id_prefixes: tuple  # an id starting with one of these belongs to the family
    model: str  # the model option that env=<option> brings (model=<model>)
    default_id: str
    learns: str  # what the defaults learn, for --help and the docs


FAMILIES = (
    Family("nethack", "nle", ("NetHack",), "nethack", "NetHackScore-v0", "NetHack's score (NLE's baseline net)"),
    Family("minihack", "minihack", ("MiniHack-",), "nethack", "MiniHack-Room-15x15-v0", "MiniHack's rooms and skills"),
    Family("minigrid", "minigrid", ("MiniGrid-", "BabyAI-"), "minigrid", "MiniGrid-DoorKey-6x6-v0", "MiniGrid's grids"),
)
BY_OPTION = {family.option: family for family in FAMILIES}
BY_MODULE = {family.module: family for family in FAMILIES}


def family_of_id(env_id: str) -> Family | None:
    """The family whose ids start like env_id, if any."""
    return next((f for f in FAMILIES if env_id.startswith(f.id_prefixes)), None)


def describe() -> str:
    """A line per family, for `--help`: its option, default id, model and extra."""
    return "\n".join(
        f'  env={f.option:<9} {f.default_id:<24} model={f.model:<9} {f.learns}; pip install ".[{f.option}]"'
        for f in FAMILIES
    )
