import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from torchbeast_hydra.backends.mono.settings import num_buffers
from torchbeast_hydra.backends.poly.settings import PolyRole
from torchbeast_hydra.config import validate
from torchbeast_hydra.env.settings import AtariPreprocessing, atari_settings
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.learning.settings import OptimName
from torchbeast_hydra.run.settings import to_plain_dict

from helpers import compose_config, run_cli


def test_defaults_are_the_ones_that_learn_pong():
    # docs/defaults.md says why each differs from TorchBeast MonoBeast's.
    cfg = compose_config()
    validate(cfg)
    assert cfg.env.id == "ALE/Pong-v5"
    assert cfg.model._target_.endswith("AtariNetBody") and not cfg.model.use_lstm
    assert (cfg.backend.name, cfg.batch_size, cfg.unroll_length) == ("mono", 8, 20)
    assert cfg.optim.name is OptimName.rmsprop
    assert (cfg.optim.learning_rate, cfg.optim.epsilon, cfg.optim.alpha) == (0.0006, 0.01, 0.99)
    assert (cfg.vtrace.entropy_cost, cfg.vtrace.baseline_cost, cfg.vtrace.discounting) == (0.01, 0.5, 0.99)
    assert cfg.optim.grad_norm_clipping == 40
    assert cfg.env.sticky_action_prob == 0.0 and cfg.env.noop_max == 30


def test_monobeast_preset_keeps_torchbeasts_defaults():
    cfg = compose_config(["experiment=monobeast"])
    validate(cfg)
    backend = cfg.backend
    assert (backend.num_actors, backend.envs_per_actor, cfg.batch_size, cfg.unroll_length) == (4, 1, 8, 80)
    assert (cfg.optim.learning_rate, cfg.vtrace.entropy_cost, cfg.optim.initial_square_avg) == (0.00048, 0.0006, 0)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["experiment=impala_atari"], dict(batch_size=32, unroll_length=20)),
        (["experiment=beefy"], dict(batch_size=4, unroll_length=80)),
        (["experiment=cartpole"], dict(total_steps=500_000)),
    ],
)
def test_experiment_presets_override_defaults(overrides, expected):
    cfg = compose_config(overrides)
    validate(cfg)
    for key, value in expected.items():
        assert cfg[key] == value


def test_impala_preset_uses_deep_lstm_net():
    cfg = compose_config(["experiment=impala_atari"])
    assert cfg.model._target_.endswith("ResNetBody") and cfg.model.use_lstm
    assert cfg.vtrace.entropy_cost == 0.01


@pytest.mark.parametrize(
    "env", ["pong", "breakout", "space_invaders", "seaquest", "qbert", "beam_rider", "ms_pacman", "cartpole"]
)
def test_every_env_preset_names_a_registered_env(env):
    import gymnasium as gym

    import torchbeast_hydra.env.make  # noqa: F401  (registers the ALE ids)

    cfg = compose_config([f"env={env}"])
    gym.spec(cfg.env.id)


@pytest.mark.parametrize("env", ["pong", "breakout", "space_invaders", "seaquest", "qbert", "beam_rider", "ms_pacman"])
def test_atari_env_options_take_the_atari_settings(env):
    cfg = compose_config([f"env={env}", "env.sticky_action_prob=0.25", "env.noop_max=0"])
    assert atari_settings(cfg.env) == AtariPreprocessing(sticky_action_prob=0.25, noop_max=0)


def test_cartpole_shows_no_atari_settings_and_an_atari_id_on_it_gets_their_defaults():
    cfg = compose_config(["env=cartpole"])
    assert set(cfg.env) == {"id", "imports", "make_kwargs", "obs_keys", "engine"}
    with pytest.raises(ConfigCompositionException):
        compose_config(["env=cartpole", "env.sticky_action_prob=0.25"])
    breakout = compose_config(["env=cartpole", "env.id=ALE/Breakout-v5"])
    validate(breakout)
    assert atari_settings(breakout.env) == AtariPreprocessing()
    cartpole_on_pong = compose_config(["env.id=CartPole-v1", "env.frame_skip=2"])  # kept, ignored by a non-Atari id
    validate(cartpole_on_pong)
    assert atari_settings(cartpole_on_pong.env).frame_skip == 2


@pytest.mark.parametrize("override", ["unroll_lenght=5", "env.idd=CartPole-v1", "optim.lr=0.1"])
def test_unknown_keys_fail_at_composition(override):
    with pytest.raises(ConfigCompositionException):
        compose_config([override])


@pytest.mark.parametrize(
    "override", ["batch_size=abc", "model.output_size=big", "optim.name=sgd", "model.use_lstm=maybe", "seed=1.5"]
)
def test_wrong_types_fail_at_composition(override):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose_config([override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["unroll_length=0"], "unroll_length"),
        (["batch_size=0"], "batch_size"),
        (["total_steps=-5"], "total_steps"),
        (["optim.learning_rate=-0.1"], "learning_rate"),
        (["vtrace.discounting=1.5"], "discounting"),
        (["device=tpu"], "device"),
        (["batch_size=64", "backend.num_buffers=16"], "larger than backend.num_buffers"),
        (["batch_size=8", "backend.num_buffers=9", "backend.envs_per_actor=4"], "deadlock"),
        (["backend=poly", "backend.address=localhost"], "use HOST:PORT"),
        (["backend=poly", "backend.address=localhost:99999"], "use HOST:PORT"),
        (["backend=poly", "backend.role=env"], "needs the learner's address"),
        (["backend=poly", "backend.max_batch_size=0"], "max_batch_size"),
        (["backend=poly", "backend.gil_switch_interval_ms=0"], "gil_switch_interval_ms must be positive"),
        (["backend=poly", "backend.envs_per_actor=300"], "max_envs_per_client"),
        (["backend=poly", "backend.num_actors=-1"], "num_actors"),
        (["env.frame_stack=0"], "frame_stack"),
        (["env=breakout", "env.sticky_action_prob=1.5"], "sticky_action_prob"),
        (["test.epsilon=-0.01"], r"test.epsilon=-0.01 must be in \[0, 1\]"),
    ],
)
def test_out_of_range_values_fail_validation(overrides, message):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_poly_defaults_listen_on_loopback_and_presets_apply_to_it():
    cfg = compose_config(["backend=poly", "experiment=cartpole"])
    validate(cfg)
    assert cfg.backend.role is PolyRole.all and cfg.backend.address.startswith("127.0.0.1:")
    assert (cfg.backend.num_actors, cfg.backend.envs_per_actor) == (2, 4)  # from the preset


def test_saved_configs_mask_the_token():
    cfg = compose_config(["backend=poly", "backend.token=s3cret"])
    assert to_plain_dict(cfg)["backend"]["token"] == "***"
    assert cfg.backend.token == "s3cret"


def test_default_buffers_hold_every_env_and_a_batch():
    cfg = compose_config(["batch_size=32"])
    resolved = validate(cfg)  # with the auto actor counts filled in
    assert num_buffers(resolved) == 32 + resolved.backend.num_actors * resolved.backend.envs_per_actor


def test_auto_actor_counts_are_sized_to_the_machine_and_explicit_ones_kept(monkeypatch):
    monkeypatch.setattr("torchbeast_hydra.backends.settings.usable_cores", lambda: 16)
    given = compose_config()
    mono, poly = validate(given), validate(compose_config(["backend=poly"]))
    assert given.backend.num_actors == 0  # the user's config is left as given: 0 means auto
    assert (mono.backend.num_actors, mono.backend.envs_per_actor) == (15, 4)
    assert (poly.backend.num_actors, poly.backend.envs_per_actor) == (4, 16)
    explicit = validate(compose_config(["backend.num_actors=3", "backend.envs_per_actor=2"]))
    assert (explicit.backend.num_actors, explicit.backend.envs_per_actor) == (3, 2)
    monkeypatch.setattr("torchbeast_hydra.backends.settings.usable_cores", lambda: 2)
    small, small_poly = validate(compose_config()), validate(compose_config(["backend=poly"]))
    assert (small.backend.num_actors, small.backend.envs_per_actor) == (2, 8)  # 16 envs, as the Pong curves had
    assert (small_poly.backend.num_actors, small_poly.backend.envs_per_actor) == (2, 16)
    monkeypatch.setattr("torchbeast_hydra.backends.settings.usable_cores", lambda: 4)
    four = validate(compose_config())
    assert (four.backend.num_actors, four.backend.envs_per_actor) == (3, 6)


def test_cli_reports_a_bad_key_in_one_clear_message(tmp_path):
    result = run_cli(tmp_path / "run", "unroll_lenght=5", check=False)
    assert result.returncode != 0
    assert "unroll_lenght" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_reports_a_bad_value_before_starting(tmp_path):
    result = run_cli(tmp_path / "run", "unroll_length=0", check=False)
    assert result.returncode == 2
    assert "unroll_length=0 must be at least 1" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "logs.csv").exists()
