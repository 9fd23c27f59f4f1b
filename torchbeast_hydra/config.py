"""Typed configuration: one dataclass per config group, registered in Hydra's ConfigStore.

Every default lives here, once, with a comment that says what the field does. The YAML files
under conf/ extend these schemas and hold only what their option changes (an env's id, a
preset's values), so a misspelt key or a value of the wrong type fails when Hydra composes the
config, before anything starts. `validate` adds the checks that types cannot express (ranges,
and how values relate to each other).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


class Mode(enum.Enum):
    train = "train"
    test = "test"  # play a trained run's checkpoint (see load_dir) and report its mean return


class OptimName(enum.Enum):
    rmsprop = "rmsprop"
    adam = "adam"


class OnNonFinite(enum.Enum):
    skip = "skip"  # drop that update (weights and optimiser state untouched) and go on
    stop = "stop"  # stop the run with an error; the last checkpoint holds the last good weights


class RewardClipping(enum.Enum):
    abs_one = "abs_one"  # to [-1, 1], as in IMPALA on Atari
    none = "none"


@dataclass
class EnvConfig:
    """What every env has; conf/env/cartpole.yaml extends it, Atari games extend AtariEnvConfig."""

    id: str = MISSING  # any gymnasium id, also gymnasium's "module:EnvId" form; each env option names its own
    # Modules to import before making envs, in every process that makes them: your gym.register calls.
    imports: List[str] = field(default_factory=list)
    # Extra keyword arguments for gymnasium.make.
    make_kwargs: Dict[str, Any] = field(default_factory=dict)
    # The observation's leaves to keep (Dict/Tuple observations), by path: e.g. [image, direction]
    # (MiniGrid: leaves out `mission`, a string), [glyphs, blstats], [inner/0]; a Dict key keeps all
    # below it. null: every leaf; a leaf that is not an array (gymnasium's Text) is then refused.
    obs_keys: Optional[List[str]] = None


@dataclass
class AtariPreprocessing:
    """TorchBeast's Atari preprocessing (grayscale frames), declared once: both env makers
    (envs.make_env and vector_envs' native AtariVectorEnv) read it through atari_settings."""

    noop_max: int = 30  # a reset is followed by 1 to noop_max no-op frames: varied starts
    frame_skip: int = 4  # each action repeats for this many frames; the last two are max-pooled
    screen_size: int = 84  # frames are resized to screen_size x screen_size
    frame_stack: int = 4  # an observation is the last frame_stack frames
    episodic_life: bool = True  # a lost life ends the episode for learning, not for logging
    fire_reset: bool = True  # press FIRE after reset in games that need it
    sticky_action_prob: float = 0.0  # ALE's repeat_action_probability (0.25: Machado et al. 2018)
    full_action_space: bool = False  # all 18 actions instead of the game's minimal set


@dataclass
class AtariEnvConfig(AtariPreprocessing, EnvConfig):
    """An Atari game (conf/env/pong.yaml and the others): what every env has, and the preprocessing."""


@dataclass
class NetHackEnvConfig(EnvConfig):
    """NLE's tasks (env=nethack): NetHackScore-v0 or any other NLE id; pip install ".[nethack]"."""

    id: str = "NetHackScore-v0"
    imports: List[str] = field(default_factory=lambda: ["nle"])  # registers NLE's ids
    # NLE computes only the observations asked for: those the NetHack model reads.
    make_kwargs: Dict[str, Any] = field(default_factory=lambda: {"observation_keys": ["glyphs", "blstats"]})


@dataclass
class MiniHackEnvConfig(EnvConfig):
    """MiniHack's tasks (env=minihack): any MiniHack id; pip install ".[minihack]"."""

    id: str = "MiniHack-Room-15x15-v0"
    imports: List[str] = field(default_factory=lambda: ["minihack"])
    make_kwargs: Dict[str, Any] = field(default_factory=lambda: {"observation_keys": ["glyphs", "blstats"]})


@dataclass
class MiniGridEnvConfig(EnvConfig):
    """MiniGrid's tasks (env=minigrid): any MiniGrid id; pip install ".[minigrid]"."""

    id: str = "MiniGrid-DoorKey-6x6-v0"
    imports: List[str] = field(default_factory=lambda: ["minigrid"])
    # The 7x7 view's (object, colour, state) codes and the agent's heading; `mission` is a string.
    obs_keys: Optional[List[str]] = field(default_factory=lambda: ["image", "direction"])


def atari_settings(env_cfg) -> AtariPreprocessing:
    """The Atari preprocessing of any env config: its own settings, the defaults for those its schema
    lacks (e.g. env.id=ALE/Breakout-v5 typed on env=cartpole, whose schema has none)."""
    given = {f.name: getattr(env_cfg, f.name) for f in fields(AtariPreprocessing) if hasattr(env_cfg, f.name)}
    return AtariPreprocessing(**given)


@dataclass
class ModelConfig:
    """What every model has: its body class (built by Hydra's instantiate, with obs_shape and the
    body's own fields beside these as keyword arguments) and the shared actor-critic core's options
    (models.ActorCritic). A model's YAML file extends its own schema below, or `base_model` plus
    nothing; a user's model YAML may list its fields without a schema: they are checked against
    the body's constructor before anything starts (models.make_model)."""

    _target_: str = MISSING  # the body class, e.g. my_pkg.models.MyBody
    use_lstm: bool = False  # an LSTM core between the body's features and the policy and baseline heads
    lstm_layers: int = 1  # with use_lstm


@dataclass
class AtariNetConfig(ModelConfig):
    """TorchBeast's shallow network (3 conv layers + fc 512), for image observations."""

    _target_: str = "torchbeast_hydra.models.AtariNetBody"
    lstm_layers: int = 2  # with use_lstm, as in TorchBeast
    output_size: int = 512  # features out of the fully connected layer


@dataclass
class ResNetConfig(ModelConfig):
    """The IMPALA paper's deep network (3 residual stacks of 16, 32, 32 channels + fc 256)."""

    _target_: str = "torchbeast_hydra.models.ResNetBody"
    channels: List[int] = field(default_factory=lambda: [16, 32, 32])  # one residual stack each
    output_size: int = 256  # features out of the fully connected layer


@dataclass
class MLPConfig(ModelConfig):
    """A multilayer perceptron for vector observations (e.g. CartPole)."""

    _target_: str = "torchbeast_hydra.models.MLPBody"
    hidden_sizes: List[int] = field(default_factory=lambda: [64, 64])  # one ReLU layer each
    normalize_obs: bool = False  # standardise observations by running statistics (checkpointed)


@dataclass
class MultiConfig(ModelConfig):
    """One encoder per observation leaf (Dict/Tuple observations): convs for images, embeddings
    for Discrete leaves, vectors flattened; concatenated, then an MLP (encoders.MultiBody)."""

    _target_: str = "torchbeast_hydra.encoders.MultiBody"
    embedding_dim: int = 16  # per Discrete entry
    conv_channels: List[int] = field(default_factory=lambda: [16, 32])  # one 3x3 conv each, for image leaves
    hidden_sizes: List[int] = field(default_factory=lambda: [256])  # ReLU layers over the concatenated features
    # Image leaves whose channels are category codes, not intensities (MiniGrid's obs/image): each
    # code embedded, a cell's embeddings summed, then the convs (encoders.CodeImageEncoder).
    code_images: List[str] = field(default_factory=list)


@dataclass
class NetHackConfig(ModelConfig):
    """NLE's baseline net for NetHack and MiniHack (encoders.NetHackBody)."""

    _target_: str = "torchbeast_hydra.encoders.NetHackBody"
    embedding_dim: int = 32  # per glyph
    crop_size: int = 9  # the egocentric view around the agent
    conv_channels: List[int] = field(default_factory=lambda: [16, 16, 16, 16, 8])  # 3x3 convs, map and crop each
    stats_hidden: int = 32  # two ReLU layers over the bottom-line stats
    output_size: int = 512  # two ReLU layers over map, crop and stats
    glyphs_key: str = "obs/glyphs"
    blstats_key: str = "obs/blstats"


@dataclass
class VtraceConfig:
    """V-trace targets and the IMPALA losses, with the IMPALA paper's values."""

    discounting: float = 0.99  # gamma
    baseline_cost: float = 0.5  # weight of the value (baseline) loss
    # Weight of the entropy bonus. MonoBeast's 0.0006 never learned Pong: see docs/defaults.md.
    entropy_cost: float = 0.01
    reward_clipping: RewardClipping = RewardClipping.abs_one
    reward_scale: float = 1.0  # rewards (after clipping) times this in the learning math, e.g. 0.1 for MuJoCo
    clip_rho_threshold: Optional[float] = 1.0  # rho-bar of the value targets; null: no clipping
    clip_pg_rho_threshold: Optional[float] = 1.0  # rho-bar for the policy gradient's advantages; null: no clipping
    # Your own loss terms, added to IMPALA's: name (ending in _loss, logged under it) ->
    # {fn: module.function (LossInputs -> scalar tensor, see learner.py), cost: its weight}, e.g.
    # +vtrace.extra_losses.kl_loss={fn:my_losses.kl_to_behaviour,cost:0.1}
    extra_losses: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    """What every optimiser has; each has its own schema below, so a config shows only its fields."""

    name: OptimName = MISSING
    learning_rate: float = 0.0006  # the IMPALA paper's (MonoBeast: 0.00048)
    epsilon: float = 0.01  # added to the denominator, for stability
    grad_norm_clipping: float = 40.0  # the gradients' global norm is clipped to this
    anneal_lr: bool = True  # linearly to zero at total_steps
    on_nonfinite: OnNonFinite = OnNonFinite.skip  # a NaN/inf loss or gradient


@dataclass
class RMSPropConfig(OptimConfig):
    """RMSProp as in TorchBeast and the IMPALA paper."""

    name: OptimName = OptimName.rmsprop
    alpha: float = 0.99  # smoothing constant
    momentum: float = 0.0  # torch's RMSProp momentum; 0: none, as in IMPALA
    # The running mean of squared gradients starts here. torch starts it at 0, which makes the
    # first updates up to 1/sqrt(1 - alpha) = 10x the learning rate: on Atari that burst kills
    # most of the conv net's ReLUs before anything is learned. TensorFlow's RMSProp (IMPALA's
    # reference implementation) starts it at 1: updates grow into the learning rate instead
    # (docs/defaults.md).
    initial_square_avg: float = 1.0


@dataclass
class AdamConfig(OptimConfig):
    """Adam (torch.optim.Adam)."""

    name: OptimName = OptimName.adam
    learning_rate: float = 0.0003
    epsilon: float = 1e-8
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # decay of the gradient's mean and square


@dataclass
class BackendConfig:
    """What both backends share: actor processes, each stepping a few envs together."""

    name: str = MISSING
    # mono: acting processes; poly: env client processes (role=all and role=env).
    # 0: auto (auto_actors): mono an actor per core but one, poly a client per 4 cores; at least 4.
    num_actors: int = 0
    # Envs per actor, stepped together: evaluated as one batch (mono) or sent as one message (poly).
    # 0: auto (auto_actors): mono 4, poly 4 per core a client gets.
    envs_per_actor: int = 0
    # Intra-op threads per learner thread; 0: auto (a CPU learner: the cores this process may use;
    # a GPU learner: a few, enough for its host-side copies, leaving the cores to the actors).
    learner_torch_threads: int = 0
    # Learner updates between copies of the weights to the acting policy (mono's actors, poly's
    # inference). 1: after every update. On a GPU the copy never makes the learner wait.
    publish_interval: int = 1
    max_actor_restarts: int = 10  # a run whose actors keep dying stops with an error


class WandbMode(enum.Enum):
    auto = "auto"  # online when credentials exist (WANDB_API_KEY or `wandb login`), else offline
    online = "online"
    offline = "offline"  # files under <run dir>/wandb; upload later with `wandb sync`
    disabled = "disabled"


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.auto
    project: str = "torchbeast_hydra"
    entity: Optional[str] = None  # None: your default entity
    group: Optional[str] = None  # None: the sweep (multirun dir) or the experiment preset's name
    name: Optional[str] = None  # None: the job's overrides, else the run dir's name
    tags: List[str] = field(default_factory=list)  # added to the env/model/backend choices
    init_timeout_s: float = 60.0  # longer than this and the run goes on without wandb


@dataclass
class MonoConfig(BackendConfig):
    """MonoBeast: actor processes step envs and run a CPU copy of the policy; rollouts travel
    through shared-memory buffers to learner threads."""

    name: str = "mono"
    # Rollout buffers in shared memory; null: 2 x envs, and at least batch_size + envs (num_buffers()).
    num_buffers: Optional[int] = None
    num_learner_threads: int = 2  # threads that batch rollouts and run learner steps (one step at a time)
    # An env's float observation beyond what the model computes with (a float64 1e300, inf) stops the run
    # naming it; true: clipped to that range instead, counted in logs.csv's clipped_obs (NaN still stops).
    clip_obs_to_model_range: bool = False


class PolyRole(enum.Enum):
    all = "all"  # the learner plus local env clients
    learner = "learner"  # the learner and its ActorPool server only; clients connect from elsewhere
    env = "env"  # env clients only, connecting to a learner at backend.address


@dataclass
class PolyConfig(BackendConfig):
    """PolyBeast: the learner hosts an ActorPool gRPC server that runs the policy for every
    connected env client in dynamic batches and assembles their unrolls. Clients connect to it
    (it never dials out), from this machine (role=all) or others (role=env); see conf/backend/poly.yaml."""

    name: str = "poly"
    role: PolyRole = PolyRole.all
    # The ActorPool server's host:port. Loopback by default; 0.0.0.0:PORT serves other machines.
    # Port 0 picks a free port. The learner writes the address it serves on to
    # RUN_DIR/actorpool_address; role=env takes HOST:PORT, or file:PATH to read it from there
    # (e.g. on a shared filesystem, waiting for the file to appear).
    address: str = "127.0.0.1:0"
    # Clients must present this shared secret. Prefer the TORCHBEAST_TOKEN environment variable,
    # which stays out of the saved config; role=all makes a random one when neither is set.
    token: Optional[str] = None
    # Central inference: up to max_batch_size envs per forward pass, waiting at most
    # batch_timeout_ms after the first request for others to join.
    max_batch_size: int = 64
    batch_timeout_ms: float = 2.0
    # Finished rollouts waiting for the learner (bounds memory); producers wait when it is full.
    learner_queue_size: int = 64
    cut_at_reset: bool = True  # an env reset ends its rollout early (a partial, masked rollout)
    max_clients: int = 64  # concurrent client streams the server accepts; more are refused with a message naming this
    # A stream the server waits on longer is dropped (its envs' unrolls go on, partial).
    client_idle_timeout_s: float = 60.0
    max_envs_per_client: int = 256  # sizes the gRPC message limit: larger steps are refused
    connect_timeout_s: float = 60.0  # clients wait this long for a learner that is not up (yet)
    inference_torch_threads: int = 1  # intra-op threads for central inference
    # Atari ids: clients step their envs in ale-py's native AtariVectorEnv where it reproduces
    # envs.Environments (see vector_envs.py); false: always the gymnasium envs.
    vector_env: bool = True


@dataclass
class LoggerConfig:
    log_interval_s: float = 5.0  # console progress line
    csv: bool = True  # logs.csv in the run dir
    tensorboard: bool = False  # scalars to RUN_DIR/tensorboard/ (needs the tensorboard package)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TestConfig:
    """mode=test: how a trained run's checkpoint is played."""

    num_episodes: int = 10  # games played; the mean return is reported
    greedy: bool = True  # argmax actions; false samples from the policy
    record_video: bool = False  # videos/ in the run dir
    # Agent steps before a game is cut: ALE's own cap, 108,000 frames at frame skip 4.
    max_episode_steps: int = 27_000
    # Sticky actions while testing; null: as trained. 0.25 is the Machado et al. (2018) protocol.
    sticky_action_prob: Optional[float] = None


@dataclass
class AccelConfig:
    """Speed options (accel.py). Those that change the numbers are off by default; each is
    checked against the fp32 result in tests/test_gpu.py."""

    cudnn_benchmark: bool = False  # cuDNN times conv algorithms per input shape and keeps the fastest
    tf32: bool = False  # TF32 matmuls and convolutions on Ampere and later GPUs (10-bit mantissa)
    # The model's forward pass under bfloat16 autocast (GPU, or CPU); V-trace and the losses stay fp32.
    bf16_autocast: bool = False
    compile: bool = False  # torch.compile the learner's model (a slow first update: it compiles)
    # One nn.LSTM call per stretch of the unroll between episode starts, rather than one per step:
    # the same math (equal to rounding), one call when no episode ends inside the unroll.
    lstm_segments: bool = True


@dataclass
class Config:
    env: EnvConfig = MISSING
    model: Any = MISSING  # a ModelConfig: each model has its own schema (or, for yours, none)
    vtrace: VtraceConfig = MISSING
    optim: Any = MISSING  # an OptimConfig subclass: RMSPropConfig or AdamConfig
    backend: Any = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    test: TestConfig = field(default_factory=TestConfig)
    accel: AccelConfig = field(default_factory=AccelConfig)

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


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="env", name="base_env", node=EnvConfig)
    cs.store(group="env", name="base_atari_env", node=AtariEnvConfig)
    cs.store(group="env", name="base_nethack_env", node=NetHackEnvConfig)
    cs.store(group="env", name="base_minihack_env", node=MiniHackEnvConfig)
    cs.store(group="env", name="base_minigrid_env", node=MiniGridEnvConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="model", name="base_atari_net", node=AtariNetConfig)
    cs.store(group="model", name="base_resnet", node=ResNetConfig)
    cs.store(group="model", name="base_mlp", node=MLPConfig)
    cs.store(group="model", name="base_multi", node=MultiConfig)
    cs.store(group="model", name="base_nethack", node=NetHackConfig)
    cs.store(group="vtrace", name="base_vtrace", node=VtraceConfig)
    cs.store(group="optim", name="base_rmsprop", node=RMSPropConfig)
    cs.store(group="optim", name="base_adam", node=AdamConfig)
    cs.store(group="backend", name="base_mono", node=MonoConfig)
    cs.store(group="backend", name="base_poly", node=PolyConfig)


def to_plain_dict(cfg) -> dict:
    """The resolved config as plain data for checkpoints and trackers, with secrets masked."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if plain.get("backend", {}).get("token"):
        plain["backend"]["token"] = "***"
    return plain


def auto_actors(backend: str, cores: int) -> tuple[int, int]:
    """(num_actors, envs_per_actor) sized to a machine with this many cores.

    mono: an actor per core but one (the learner process's batching and Python need a core),
    4 envs each, and never fewer than the 4 x 4 that the 2-core figures were taken with.
    poly: a client per 4 cores (each steps its envs on cores // clients native threads, Atari),
    with 4 envs per thread in each message: many envs per message keeps the server's per-message
    cost small.
    """
    if backend == "poly":
        clients = max(4, cores // 4)
        return clients, max(4, 4 * (cores // clients))
    return max(4, cores - 1), 4


def usable_cores() -> int:
    """The cores this process may run on (a SLURM job's allocation, not the whole node)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_auto(cfg) -> None:
    """Replaces backend.num_actors / envs_per_actor left at 0 (auto) with auto_actors' sizes."""
    backend = cfg.backend
    if backend.num_actors == 0 or backend.envs_per_actor == 0:
        actors, envs = auto_actors(backend.name, usable_cores())
        if backend.num_actors == 0:
            backend.num_actors = actors
        if backend.envs_per_actor == 0:
            backend.envs_per_actor = envs


def num_buffers(cfg) -> int:
    """Rollout buffers for mono: explicit, or enough for every env plus a batch in flight."""
    backend = cfg.backend
    if backend.num_buffers is not None:
        return backend.num_buffers
    num_envs = backend.num_actors * backend.envs_per_actor
    return max(2 * num_envs, cfg.batch_size + num_envs)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# Config's fields typed Any: a plain dict there (from a YAML file that extends no schema) is
# checked against the schema its name selects. A model's plain dict is the user's own model:
# models.make_model checks its fields against the body's constructor.
_SCHEMAS_BY_NAME = {
    "optim": {"rmsprop": RMSPropConfig, "adam": AdamConfig},
    "backend": {"mono": MonoConfig, "poly": PolyConfig},
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
    _check(name in by_name, f"{path}.name={name}: use {' or '.join(by_name)}.")
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


def validate(cfg) -> None:
    """Checks that types cannot express; raises ConfigError naming the key and a fix.

    Auto sizes (0) are resolved first (resolve_auto), so the checks see what will run.
    """
    check_keys(cfg)
    if cfg.backend.num_actors >= 0 and cfg.backend.envs_per_actor >= 0:
        resolve_auto(cfg)
    _check(cfg.total_steps > 0, f"total_steps={cfg.total_steps} must be positive.")
    _check(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be at least 1.")
    _check(cfg.unroll_length >= 1, f"unroll_length={cfg.unroll_length} must be at least 1.")
    _check(cfg.checkpoint_interval_s > 0, "checkpoint_interval_s must be positive.")
    _check(
        cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"),
        f"device={cfg.device!r}: use auto, cpu, cuda or cuda:N.",
    )
    _check(0.0 <= cfg.vtrace.discounting <= 1.0, "vtrace.discounting must be in [0, 1].")
    for key in ("baseline_cost", "entropy_cost"):
        _check(cfg.vtrace[key] >= 0, f"vtrace.{key} must be >= 0.")
    _check(cfg.vtrace.reward_scale > 0, "vtrace.reward_scale must be positive.")
    for key in ("clip_rho_threshold", "clip_pg_rho_threshold"):
        value = cfg.vtrace[key]
        _check(value is None or value > 0, f"vtrace.{key} must be positive or null (no clipping).")
    for name, term in cfg.vtrace.extra_losses.items():
        _check(
            isinstance(term, Mapping)
            and set(term) == {"fn", "cost"}
            and isinstance(term["fn"], str)
            and isinstance(term["cost"], (int, float))
            and not isinstance(term["cost"], bool),
            f"vtrace.extra_losses.{name} must be {{fn: module.function, cost: a number}}, e.g. "
            f"+vtrace.extra_losses.{name}={{fn:my_losses.kl_to_behaviour,cost:0.1}}.",
        )
    _check(cfg.optim.learning_rate > 0, f"optim.learning_rate={cfg.optim.learning_rate} must be positive.")
    _check(cfg.optim.epsilon > 0, "optim.epsilon must be positive.")
    _check(cfg.optim.grad_norm_clipping > 0, "optim.grad_norm_clipping must be positive.")
    if OptimName(cfg.optim.name) is OptimName.adam:
        _check(len(cfg.optim.betas) == 2, "optim.betas must have two values, e.g. [0.9,0.999].")
    _check(
        bool(cfg.model.get("_target_")),
        "model._target_ must name the model's body class, "
        "e.g. model._target_=my_pkg.models.MyBody (see the README's Extending section).",
    )
    _check(cfg.model.get("lstm_layers", 1) >= 1, "model.lstm_layers must be at least 1.")
    atari = atari_settings(cfg.env)
    _check(atari.frame_stack >= 1 and atari.frame_skip >= 1, "env.frame_stack and env.frame_skip must be >= 1.")
    _check(0.0 <= atari.sticky_action_prob <= 1.0, "env.sticky_action_prob must be in [0, 1].")
    _check(atari.noop_max >= 0, "env.noop_max must be >= 0.")
    _check(atari.screen_size >= 1, "env.screen_size must be at least 1.")
    _check(cfg.logger.log_interval_s > 0, "logger.log_interval_s must be positive.")
    _check(cfg.test.max_episode_steps >= 1, "test.max_episode_steps must be at least 1.")
    sticky = cfg.test.sticky_action_prob
    _check(
        sticky is None or 0 <= sticky <= 1, f"test.sticky_action_prob={sticky} must be in [0, 1] (or null: as trained)."
    )
    _check(cfg.backend.max_actor_restarts >= 0, "backend.max_actor_restarts must be >= 0.")
    _check(cfg.backend.learner_torch_threads >= 0, "backend.learner_torch_threads must be >= 0 (0: auto).")
    _check(cfg.backend.publish_interval >= 1, "backend.publish_interval must be at least 1 (updates).")
    _check(cfg.test.num_episodes >= 1, "test.num_episodes must be at least 1.")
    _check(cfg.backend.num_actors >= 1, "backend.num_actors must be at least 1 (or 0: auto).")
    _check(cfg.backend.envs_per_actor >= 1, "backend.envs_per_actor must be at least 1 (or 0: auto).")
    _validate_wandb(cfg.logger.wandb)
    if cfg.backend.name == "mono":
        _validate_mono(cfg)
    elif cfg.backend.name == "poly":
        _validate_poly(cfg)


def _validate_wandb(wandb) -> None:
    _check(bool(wandb.project and wandb.project.strip()), "logger.wandb.project must not be empty.")
    _check(
        not any(c in wandb.project for c in "/\\#?%:"),
        f"logger.wandb.project={wandb.project!r} may not contain / \\ # ? % or :.",
    )
    _check(wandb.init_timeout_s > 0, "logger.wandb.init_timeout_s must be positive.")
    for tag in wandb.tags:
        _check(0 < len(str(tag)) <= 64, f"logger.wandb.tags: {tag!r} must be 1 to 64 characters.")


def _validate_mono(cfg) -> None:
    backend = cfg.backend
    _check(backend.num_learner_threads >= 1, "backend.num_learner_threads must be at least 1.")
    buffers = num_buffers(cfg)
    _check(
        cfg.batch_size <= buffers,
        f"batch_size={cfg.batch_size} is larger than backend.num_buffers={buffers}: "
        f"raise backend.num_buffers (or leave it null) or lower batch_size.",
    )
    # Actors get envs_per_actor buffers at a time, while the learner may hold batch_size-1.
    needed = cfg.batch_size + backend.envs_per_actor - 1
    _check(
        buffers >= needed,
        f"backend.num_buffers={buffers} can deadlock with batch_size={cfg.batch_size}, "
        f"backend.envs_per_actor={backend.envs_per_actor}: use at least {needed}.",
    )


ADDRESS_FILE_PREFIX = "file:"


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or '[::1]:port') -> (host, port); raises ConfigError naming backend.address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"backend.address={address!r}: use HOST:PORT, e.g. 127.0.0.1:4431.")
    return host, int(port)


def _validate_poly(cfg) -> None:
    backend = cfg.backend
    role = PolyRole(backend.role)
    if role is PolyRole.env and backend.address.startswith(ADDRESS_FILE_PREFIX):
        _check(len(backend.address) > len(ADDRESS_FILE_PREFIX), "backend.address=file:PATH needs a path.")
    else:
        _, port = split_address(backend.address)
        _check(
            role is not PolyRole.env or port != 0,
            "backend.role=env needs the learner's address: backend.address=HOST:PORT (or file:PATH).",
        )
    for key in ("max_batch_size", "learner_queue_size", "max_clients"):
        _check(backend[key] >= 1, f"backend.{key} must be at least 1.")
    _check(backend.batch_timeout_ms >= 0, "backend.batch_timeout_ms must be >= 0.")
    _check(backend.connect_timeout_s > 0, "backend.connect_timeout_s must be positive.")
    _check(backend.client_idle_timeout_s > 0, "backend.client_idle_timeout_s must be positive.")
    _check(backend.inference_torch_threads >= 1, "backend.inference_torch_threads must be at least 1.")
    _check(backend.max_envs_per_client >= 1, "backend.max_envs_per_client must be at least 1.")
    _check(
        backend.envs_per_actor <= backend.max_envs_per_client,
        f"backend.envs_per_actor={backend.envs_per_actor} is above backend.max_envs_per_client="
        f"{backend.max_envs_per_client}, which sizes the message limit: raise it.",
    )
