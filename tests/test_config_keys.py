"""A key that no schema declares is refused at start, however it arrives; the user's dicts stay open."""

import textwrap

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from torchbeast_hydra.__main__ import CONFIG_DIR
from torchbeast_hydra.config import validate
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.overrides import check_overrides

from helpers import TINY, compose_config, run_cli


def compose_with(conf_dir, overrides):
    """The config with conf_dir searched too, as `--config-dir conf_dir` does."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"hydra.searchpath=[file://{conf_dir}]"])
    OmegaConf.set_readonly(cfg, False)
    return cfg


def write(conf_dir, path, text):
    (conf_dir / path).parent.mkdir(parents=True, exist_ok=True)
    (conf_dir / path).write_text(textwrap.dedent(text))


@pytest.mark.parametrize(
    "overrides, key, near",
    [
        (["+env.frame_stak=3"], "env.frame_stak", "env.frame_stack"),
        (["+model.use_lsmt=true"], "model.use_lsmt", "model.use_lstm"),  # atari_net: a core field
        (["model=mlp", "+model.hidden_size=[32]"], "model.hidden_size", "model.hidden_sizes"),
        (["+vtrace.discount=0.9"], "vtrace.discount", "vtrace.discounting"),
        (["+optim.learning_rat=0.001"], "optim.learning_rat", "optim.learning_rate"),
        (["optim=adam", "+optim.beta=[0.9,0.99]"], "optim.beta", "optim.betas"),
        (["+backend.num_actor=2"], "backend.num_actor", "backend.num_actors"),
        (["backend=poly", "+backend.adress=h:1"], "backend.adress", "backend.address"),
        (["+logger.log_interval=5"], "logger.log_interval", "logger.log_interval_s"),
        (["+logger.wandb.projekt=x"], "logger.wandb.projekt", "logger.wandb.project"),
        (["+test.num_episode=3"], "test.num_episode", "test.num_episodes"),
        (["+unroll_lenght=5"], "unroll_lenght", "unroll_length"),
        (["++batch_sise=5"], "batch_sise", "batch_size"),
    ],
)
def test_a_key_added_with_plus_is_refused_naming_it_and_the_nearest(overrides, key, near):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    message = str(error.value)
    assert f"unknown key {key} " in message
    assert f"did you mean {near}?" in message
    assert "\n" not in message
    assert "+env.make_kwargs.KEY=VALUE" in message  # where a key of one's own goes


def test_a_key_like_no_declared_one_is_refused_without_a_guess():
    cfg = compose_config(["+foo=1"])
    with pytest.raises(ConfigError, match="unknown key foo in Config") as error:
        validate(cfg)
    assert "did you mean" not in str(error.value)


def test_every_unknown_key_is_named_at_once():
    cfg = compose_config(["+optim.learning_rat=0.1", "+test.greddy=false"])
    with pytest.raises(ConfigError, match="optim.learning_rat .*test.greddy"):
        validate(cfg)


def test_a_yaml_file_without_a_schema_is_checked_against_the_one_its_name_selects(tmp_path):
    """optim and backend are typed Any (each option extends its own schema): a YAML file that
    extends none composes as a plain dict, so its keys are checked against its name's schema."""
    write(
        tmp_path,
        "optim/mine.yaml",
        """\
        name: adam
        learning_rate: 0.001
        epsilon: 1.0e-8
        betas: [0.9, 0.999]
        grad_norm_clipping: 40.0
        anneal_lr: true
        on_nonfinite: skip
        momentum: 0.9
        """,
    )
    write(tmp_path, "backend/mine.yaml", "name: mono\nnum_actors: 2\nenvs_per_actor: 2\nnum_buffer: 8\n")
    write(tmp_path, "optim/sgd.yaml", "name: sgd\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key optim\.momentum in AdamConfig"):
        validate(compose_with(tmp_path, ["optim=mine"]))
    with pytest.raises(ConfigError, match=r"backend\.num_buffer in MonoConfig \(did you mean backend\.num_buffers\?\)"):
        validate(compose_with(tmp_path, ["backend=mine"]))
    with pytest.raises(ConfigError, match=r"optim\.name=sgd: use rmsprop or adam"):
        validate(compose_with(tmp_path, ["optim=sgd"]))


def test_a_preset_that_picks_such_a_file_is_refused(tmp_path):
    write(tmp_path, "backend/mine.yaml", "name: poly\nrole: all\nvector_envs: false\n")
    write(
        tmp_path,
        "experiment/mine.yaml",
        """\
        # @package _global_
        defaults:
          - override /backend: mine
        """,
    )
    with pytest.raises(ConfigError, match=r"backend\.vector_envs in PolyConfig \(did you mean backend\.vector_env\?\)"):
        validate(compose_with(tmp_path, ["experiment=mine"]))


def test_a_preset_setting_an_undeclared_key_of_a_schema_fails_when_hydra_composes_it(tmp_path):
    """Typed nodes refuse a YAML file's unknown key as Hydra merges it (only `+` gets past that)."""
    write(tmp_path, "experiment/typo.yaml", "# @package _global_\noptim:\n  learning_rat: 0.1\n")
    with pytest.raises(ConfigCompositionException, match="learning_rat"):
        compose_with(tmp_path, ["experiment=typo"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["+env.make_kwargs.repeat_action_probability=0.25", "+env.make_kwargs.nested={a:1}"],
        ["+vtrace.extra_losses.kl_loss={fn:my_losses.kl_to_behaviour,cost:0.1}"],
        ["model=base_model", "model._target_=my_models.Wide", "+model.width=64"],  # the body's own field
        ["model=wide", "+model.depth=3"],  # a model without a schema: make_model checks its fields
        ["experiment=cartpole", "+hydra.job.env_set.FOO=1"],  # Hydra's own keys are Hydra's
    ],
)
def test_the_users_dicts_stay_open(tmp_path, overrides):
    write(tmp_path, "model/wide.yaml", "_target_: my_models.Wide\nuse_lstm: false\nwidth: 256\n")
    validate(compose_with(tmp_path, overrides))


def test_cli_refuses_a_key_added_with_plus_before_starting(tmp_path):
    result = run_cli(tmp_path / "run", *TINY, "+optim.learning_rat=0.001", check=False, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "unknown key optim.learning_rat in AdamConfig (did you mean optim.learning_rate?)" in output
    assert "Traceback" not in output
    assert not (tmp_path / "run" / "logs.csv").exists()


# -- overrides checked before Hydra composes (overrides.check_overrides) ------------------------------


def refusal(*argv):
    with pytest.raises(ConfigError) as error:
        check_overrides(list(argv), CONFIG_DIR)
    return str(error.value)


def test_a_value_of_the_wrong_type_is_refused_in_one_line_before_hydra_composes(tmp_path):
    assert refusal("total_steps=abc").startswith("total_steps=abc: Value 'abc'")
    assert "give batch_size a value of its type" in refusal("-m", "batch_size=4,big")  # each value of a sweep
    assert "model.use_lstm=maybe" in refusal("model.use_lstm=maybe")
    check_overrides(["total_steps=5000", "env.make_kwargs={a: 1}", "eval.stop_at_return=null"], CONFIG_DIR)
    result = run_cli(tmp_path / "run", *TINY, "total_steps=abc", check=False, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "error: total_steps=abc: " in output, output
    assert "HYDRA_FULL_ERROR" not in output


def test_a_misspelt_key_without_plus_gets_the_nearest_name_not_hydras_append_hint():
    message = refusal("optim.learning_rat=0.001")
    assert "optim.learning_rat: no such key in RMSPropConfig" in message
    assert "Did you mean optim.learning_rate?" in message and "+optim.learning_rat" not in message
    assert "Did you mean optim.betas?" in refusal("optim=adam", "optim.beta=[0.9,0.99]")  # the chosen option's schema
    assert "Did you mean unroll_length?" in refusal("-m", "unroll_lenght=3,4")


def test_a_misspelt_option_gets_the_nearest_option_and_never_the_schemas():
    message = refusal("env=cartpol")
    assert "did you mean env=cartpole?" in message and "pong" in message
    assert "base_" not in message
    assert "did you mean model=resnet?" in refusal("-m", "model=atari_net,resnt")


def test_keys_of_ones_own_are_pointed_at_plus():
    assert "+env.make_kwargs.frameskip=VALUE" in refusal("env.make_kwargs.frameskip=2")
    message = refusal("experiment=cartpole", "model.hidden_size=[3]")
    assert "Did you mean model.hidden_sizes?" in message and "+model.hidden_size=VALUE" in message


def test_good_overrides_pass_the_check():
    check_overrides(
        ["experiment=cartpole", "optim=adam", "optim.betas=[0.9,0.99]", "+env.make_kwargs.x=1", "hydra.run.dir=x"],
        CONFIG_DIR,
    )
    check_overrides(["-m", "env=pong,breakout", "seed=1,2", "model.use_lstm=true"], CONFIG_DIR)


def test_options_of_ones_own_config_dir_pass_the_check(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "wide.yaml").write_text("defaults:\n  - base_mlp\n  - _self_\nhidden_sizes: [512]\n")
    check_overrides(["--config-dir", str(tmp_path), "model=wide"], CONFIG_DIR)
    check_overrides([f"--config-dir={tmp_path}", "model=wide"], CONFIG_DIR)
    assert "did you mean model=wide?" in refusal("-cd", str(tmp_path), "model=wid")
