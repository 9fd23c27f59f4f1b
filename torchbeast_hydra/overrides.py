"""The command line's overrides, checked before Hydra composes the config: an option that no
group has, or a key that no config has, is refused with the nearest names in our one-line style
(Hydra's own messages would list the schemas, base_env, ..., among a group's options, and tell a
user who misspelt a key to append it with `+`). So is an option file the command picks (a preset,
a suite's task) that sets a key no schema declares, for every option a sweep goes through, before
its first job starts."""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path

from hydra.core.override_parser.types import OverrideType
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, ValidationError

from torchbeast_hydra.agent.settings import ModelConfig
from torchbeast_hydra.errors import ConfigError


def check_overrides(argv: list[str], config_dir: str) -> None:
    """Refuses, before Hydra composes, an override that names no option of a group or no key, with
    the nearest names. Hydra's own messages would list the schemas (base_env, ...) among a group's
    options, and tell a user who misspelt a key to append it with `+`."""
    extra_dirs, searchpath = _extra_config_dirs(argv)
    if searchpath:
        return  # options may come from anywhere (pkg://...): Hydra's own messages
    overrides = _parse_overrides(argv)
    groups = option_files(config_dir)
    for extra in extra_dirs:  # --config-dir: the user's own options of each group
        for group, options in option_files(extra).items():
            groups[group] = sorted({*groups.get(group, []), *options})
    choices, keys = [], []
    for override in overrides:
        name = override.key_or_group
        if name in groups:
            choices.append(override)
            for value in _values(override):
                _check_option(name, value, groups[name])
        elif override.type is OverrideType.CHANGE and not name.startswith("hydra") and "/" not in name:
            keys.append(override)
    first_choices = [_first_choice(o) for o in choices]
    search = [f"hydra.searchpath=[{','.join(f'file://{Path(d).resolve()}' for d in extra_dirs)}]"] if extra_dirs else []
    cfg = _compose([*first_choices, *search], config_dir)
    if cfg is None:
        return  # Hydra's own message for what it cannot compose
    if keys:
        _check_keys_exist(keys, cfg)
    if "-m" in argv or "--multirun" in argv:
        for group, values in _swept_options(cfg, choices, groups).items():
            others = [c for c, o in zip(first_choices, choices) if o.key_or_group != group]
            for value in values:
                _compose([*others, f"{group}={value}", *search], config_dir)


def option_files(config_dir: str) -> dict:
    """Each config group of conf/ (env, model, ...) -> its options, read from the files: the schemas
    registered in code (base_*) are never options a user picks."""
    root = Path(config_dir)
    return {
        d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in root.iterdir() if d.is_dir() and d.name != "hydra"
    }


def _extra_config_dirs(argv: list[str]) -> tuple[list[str], bool]:
    """(the --config-dir/-cd dirs, whether hydra.searchpath is set) of a command line."""
    dirs, searchpath = [], False
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in ("--config-dir", "-cd"):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value and Path(value).is_dir():
                dirs.append(value)
        searchpath |= flag.lstrip("+") == "hydra.searchpath"
    return dirs, searchpath


def _parse_overrides(argv: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    texts = [arg for arg in argv if "=" in arg and not arg.startswith("-")]
    try:
        return OverridesParser.create().parse_overrides(texts)
    except Exception:  # a syntax error: Hydra's own message says where
        return []


def _values(override) -> list[str]:
    if override.type is OverrideType.DEL:
        return []
    try:
        if override.is_sweep_override():
            return [str(v) for v in override.sweep_string_iterator()]
        value = override.value()
    except Exception:  # a glob or range sweep over options: Hydra expands and checks those
        return []
    return [] if value is None else [str(value)]


def _check_option(group: str, value: str, options: list[str]) -> None:
    if value in options or value == "null":
        return
    near = difflib.get_close_matches(value, options, n=1)
    hint = f"did you mean {group}={near[0]}? " if near else ""
    raise ConfigError(f"{group}={value}: no such option; {hint}{group} options: {', '.join(options)}.")


def _first_choice(override) -> str:
    values = _values(override)
    prefix = {OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++", OverrideType.DEL: "~"}.get(override.type, "")
    return f"{prefix}{override.key_or_group}={values[0] if values else 'null'}"


def _compose(choices: list[str], config_dir: str):
    """The config (with Hydra's own) that these group choices compose; None where Hydra cannot
    compose it (its own message follows), but ConfigError where an option file the choices pick
    sets a key no schema declares or a value its key's type cannot take."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            return compose(config_name="config", overrides=choices, return_hydra_config=True)
    except ConfigCompositionException as error:
        _refuse_option_file(error)
        return None
    except Exception:
        return None


def _refuse_option_file(error) -> None:
    """ConfigError for Hydra's `In 'task/X': ConfigKeyError ...` (an option file setting a key its
    schema lacks) or a value of the wrong type there; nothing for any other failure."""
    cause = error.__cause__ or error.__context__
    where = re.match(r"In '([^']+)'", str(error))
    if where is None or not isinstance(cause, (ConfigKeyError, ValidationError)) or not cause.full_key:
        return
    option = where.group(1)
    group, _, name = option.rpartition("/")
    head = f"{group}={name}: {option}.yaml sets {cause.full_key}"
    schema = cause.object_type
    if isinstance(cause, ConfigKeyError) and dataclasses.is_dataclass(schema):
        declared = [f.name for f in dataclasses.fields(schema)]
        near = difflib.get_close_matches(str(cause.key), declared, n=1)
        parent = cause.full_key.rpartition(".")[0]
        hint = f" (did you mean {parent + '.' if parent else ''}{near[0]}?)" if near else ""
        raise ConfigError(f"{head}, which {schema.__name__} does not declare{hint}: correct or remove it there.")
    first = str(cause).splitlines()[0]
    raise ConfigError(f"{head}: {first}; give it a value of its type there.")


def _swept_options(cfg: DictConfig, choices: list, groups: dict) -> dict:
    """{group: its options} for each config group a multirun sweeps: on the command line or in the
    preset's hydra.sweeper.params (a suite's `task: CartPole-v1,Acrobot-v1`); the command line wins."""
    swept = {}
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    if isinstance(params, DictConfig):
        lines = [f"{key}={value}" for key, value in params.items() if key in groups and value is not None]
        for override in _parse_overrides(lines):
            swept[override.key_or_group] = _values(override)
    for override in choices:
        if override.is_sweep_override():
            swept[override.key_or_group] = _values(override)
        else:
            swept.pop(override.key_or_group, None)  # one option, given: the command line wins
    for group, values in swept.items():
        for value in values:
            _check_option(group, value, groups[group])
    return swept


def _check_keys_exist(keys: list, cfg: DictConfig) -> None:
    """Each key must be in the config that the command's group choices compose (without `+`, Hydra
    only changes keys that exist), and each of its values must fit the key's type."""
    for override in keys:
        key = override.key_or_group
        parent_path, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_path, default=None) if parent_path else cfg
        if not isinstance(parent, DictConfig):
            continue  # a parent that is not a dict: Hydra's message names the missing part
        if leaf not in parent:
            raise ConfigError(_unknown_key_message(key, parent))
        for value in _parsed_values(override):
            _check_type(cfg, key, value)


def _parsed_values(override) -> list:
    """The override's values as Hydra parsed them (numbers, lists, ...); none where it cannot say."""
    try:
        return list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    except Exception:  # a glob or range sweep: Hydra expands and checks those
        return []


def _check_type(cfg: DictConfig, key: str, value) -> None:
    """Refuses a value that the key's schema cannot take (total_steps=abc), as every config error is
    refused: one line, exit 2 (Hydra's message would come with its exit code 1)."""
    try:
        with open_dict(cfg):  # a dict of the user's own (env.make_kwargs={a: 1}) takes new keys
            OmegaConf.update(cfg, key, value, merge=True)
    except ValidationError as error:
        first = str(error).splitlines()[0]
        raise ConfigError(f"{key}={value}: {first}; give {key} a value of its type.") from None
    except Exception:  # anything else: Hydra's own message, when it composes
        return


def _unknown_key_message(key: str, parent: DictConfig) -> str:
    schema = OmegaConf.get_type(parent)
    if not dataclasses.is_dataclass(schema):  # a dict of the user's own, such as env.make_kwargs
        return f"{key} is not in the config yet: add a key of your own with +{key}=VALUE."
    parent_path, _, leaf = key.rpartition(".")
    near = difflib.get_close_matches(leaf, list(parent), n=1)
    hint = f" Did you mean {parent_path + '.' if parent_path else ''}{near[0]}?" if near else ""
    if issubclass(schema, ModelConfig):
        own = f" A field of your own model's body: +{key}=VALUE."
    else:
        own = " Keys of your own go in env.make_kwargs: +env.make_kwargs.KEY=VALUE."
    return f"{key}: no such key in {schema.__name__}.{hint} Its keys: {', '.join(parent)}.{own}"
