"""The config: Hydra composes conf/ over typed schemas, and this module checks the result.

Each package owns its slice of the config, beside its code: its dataclasses (the schemas, every
default once, with a comment that says what the field does), its checks and its derived values,
in its settings module (env/, agent/, learning/, logs/, run/, backends/ and each backend's). This
module only puts them together: the top-level `Config`, the groups registered in Hydra's
ConfigStore, the refusal of keys no schema declares, and `validate`, which calls each package's
checks on a resolved copy and returns it (the user's config is never changed).

The command line's overrides are checked before Hydra composes them in overrides.py.

The YAML files under conf/ extend these schemas and hold only what their option changes, so a
misspelt key or a value of the wrong type fails when Hydra composes the config, before anything
starts.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from torchbeast_hydra.agent import settings as agent_settings
from torchbeast_hydra.agent.settings import (
    AtariNetConfig,
    MLPConfig,
    ModelConfig,
    MultiConfig,
    NetHackConfig,
    ResNetConfig,
)
from torchbeast_hydra.backends import registry
from torchbeast_hydra.backends import settings as backend_settings
from torchbeast_hydra.env import settings as env_settings
from torchbeast_hydra.env.settings import (
    AtariEnvConfig,
    EnvConfig,
    MiniGridEnvConfig,
    MiniHackEnvConfig,
    NetHackEnvConfig,
)
from torchbeast_hydra.errors import ConfigError, require
from torchbeast_hydra.evaluation import settings as evaluation_settings
from torchbeast_hydra.evaluation.settings import EvalConfig, TestConfig
from torchbeast_hydra.launch import settings as launch_settings
from torchbeast_hydra.launch.settings import DistributedConfig
from torchbeast_hydra.learning import settings as learning_settings
from torchbeast_hydra.learning.settings import AccelConfig, AdamConfig, RMSPropConfig, VtraceConfig
from torchbeast_hydra.logs import settings as logs_settings
from torchbeast_hydra.logs.settings import LoggerConfig
from torchbeast_hydra.pbt import settings as pbt_settings
from torchbeast_hydra.pbt.settings import KeyMutation, PbtConfig
from torchbeast_hydra.run import settings as run_settings


class Mode(enum.Enum):
    train = "train"
    test = "test"  # play a trained run's checkpoint (see load_dir) and report its mean return


@dataclass
class Config:
    env: EnvConfig = MISSING
    model: Any = MISSING  # a ModelConfig: each model has its own schema (or, for yours, none)
    vtrace: VtraceConfig = MISSING
    optim: Any = MISSING  # an OptimConfig subclass: RMSPropConfig or AdamConfig
    backend: Any = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    test: TestConfig = field(default_factory=TestConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    accel: AccelConfig = field(default_factory=AccelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # ranks beyond one: launch/distributed.py
    pbt: PbtConfig = field(default_factory=PbtConfig)  # population-based training: pbt/, docs/pbt.md

    mode: Mode = Mode.train  # train | test
    seed: int = 1  # the network's initialisation and every env's and actor's randomness derive from it
    total_steps: int = 20_000_000  # environment steps (agent steps, i.e. after frame skipping)
    batch_size: int = 8  # unrolls per learner step
    unroll_length: int = 20  # T: steps per unroll (80 in MonoBeast: see docs/defaults.md)
    device: str = "auto"  # auto | cpu | cuda | cuda:N; auto: cuda when available, else cpu
    checkpoint_interval_s: float = 600.0  # also at the end of the run and when it is stopped
    check_memory: bool = True  # refuse a config whose memory estimate exceeds the machine's (memory.py)
    # mode=test: the trained run dir whose checkpoint to play; the results go to this run's own dir
    # (default: this run dir, for a test started in a trained run's dir).
    load_dir: Optional[str] = None


# The schemas registered for each group; their names start with base_ (conf/ files extend them),
# which marks them as schemas, never as options a user picks.
SCHEMAS = {
    "env": dict(
        base_env=EnvConfig,
        base_atari_env=AtariEnvConfig,
        base_nethack_env=NetHackEnvConfig,
        base_minihack_env=MiniHackEnvConfig,
        base_minigrid_env=MiniGridEnvConfig,
    ),
    "model": dict(
        base_model=ModelConfig,
        base_atari_net=AtariNetConfig,
        base_resnet=ResNetConfig,
        base_mlp=MLPConfig,
        base_multi=MultiConfig,
        base_nethack=NetHackConfig,
    ),
    "vtrace": dict(base_vtrace=VtraceConfig),
    "optim": dict(base_rmsprop=RMSPropConfig, base_adam=AdamConfig),
    "backend": {f"base_{name}": kind.schema for name, kind in registry.BACKENDS.items()},
    "pbt": dict(base_pbt=PbtConfig, base_key_mutation=KeyMutation),  # conf/pbt/ sets the root's pbt (global)
}
SCHEMA_PREFIX = "base_"


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            cs.store(group=group, name=name, node=schema)


# Each package's checks, in the order of the data path; each reads its own slice.
CHECKS = (
    run_settings.check,
    env_settings.check,
    agent_settings.check,
    learning_settings.check,
    logs_settings.check,
    backend_settings.check,
    evaluation_settings.check,
    launch_settings.check,
    pbt_settings.check,
)


# Config's fields typed Any: a plain dict there (from a YAML file that extends no schema) is
# checked against the schema its name selects. A model's plain dict is the user's own model:
# models.make_model checks its fields against the body's constructor.
_SCHEMAS_BY_NAME = {
    group: {name.removeprefix(SCHEMA_PREFIX): schema for name, schema in SCHEMAS[group].items()}
    for group in ("optim", "backend")
}


def check_keys(cfg) -> None:
    """Refuses a key that no schema declares, naming it and the nearest declared key.

    Hydra refuses most such keys when it composes the config, but `+key` (and `++key`) add them to
    typed nodes too. Each node keeps its dataclass (OmegaConf.get_type), so its keys are compared
    with that dataclass's fields. Plain dicts (fields typed Dict[str, Any], such as env.make_kwargs)
    are the user's and stay open, and so are a body's own fields beside ModelConfig's, which
    models.make_model checks against the body's constructor. Hydra's own `hydra` key is Hydra's.
    """
    unknown, open_dicts = [], []
    _collect_unknown_keys(cfg, "", unknown, open_dicts)
    if unknown:
        raise ConfigError(
            f"{'; '.join(unknown)}. Keys of your own go only in {', '.join(open_dicts)} "
            f"(e.g. +{open_dicts[0]}.KEY=VALUE)."
        )


def _schema_of(node: DictConfig, path: str):
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        return schema
    if path not in _SCHEMAS_BY_NAME:
        return None
    by_name = _SCHEMAS_BY_NAME[path]
    name = node.get("name")
    require(name in by_name, f"{path}.name={name}: use {' or '.join(by_name)}.")
    return by_name[name]


def _collect_unknown_keys(node: DictConfig, path: str, unknown: list[str], open_dicts: list[str]) -> None:
    """Appends a message for each undeclared key under node, and the open dicts' paths."""
    schema = _schema_of(node, path)
    if schema is None:
        open_dicts.append(path)
        return
    declared = [f.name for f in dataclasses.fields(schema)]
    prefix = f"{path}." if path else ""
    for key in node:
        if key in declared:
            if not OmegaConf.is_missing(node, key) and isinstance(node[key], DictConfig):
                _collect_unknown_keys(node[key], prefix + key, unknown, open_dicts)
        elif schema is not ModelConfig and prefix + key != "hydra":  # ModelConfig's extra keys are the body's
            near = difflib.get_close_matches(key, declared, n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
            unknown.append(f"unknown key {prefix}{key} in {schema.__name__}{hint}")


def validate(cfg: DictConfig) -> DictConfig:
    """Checks what types cannot express; raises ConfigError naming the key and a fix.

    Returns the config the run uses: a copy with the derived values filled in (auto actor sizes,
    backends.settings.resolve_auto), so the checks see what will run and the user's config, as
    composed and saved by Hydra, stays as given.
    """
    check_keys(cfg)
    resolved = copy.deepcopy(cfg)
    OmegaConf.set_readonly(resolved, False)
    backend = registry.get(resolved.backend.name)
    if resolved.backend.num_actors >= 0 and resolved.backend.envs_per_actor >= 0:
        backend_settings.resolve_auto(resolved.backend, backend.auto_actors)
    for check in CHECKS:
        check(resolved)
    backend.check(resolved)
    return resolved
