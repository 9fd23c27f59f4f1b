"""The learning math's settings: V-trace and the IMPALA losses (vtrace group), the optimiser
(optim group) and the speed options (accel), with the checks that types cannot express."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from torchbeast_hydra.errors import require


class OptimName(enum.Enum):
    rmsprop = "rmsprop"
    adam = "adam"


class OnNonFinite(enum.Enum):
    skip = "skip"  # drop that update (weights and optimiser state untouched) and go on
    stop = "stop"  # stop the run with an error; the last checkpoint holds the last good weights


class MinibatchUnit(enum.Enum):
    """What optim.minibatches splits a batch into."""

    # Whole unrolls (batch columns): the V-trace targets are recomputed in each minibatch from the
    # learner's current values. Any model, LSTM included.
    unrolls = "unrolls"
    # Single steps drawn at random from the whole batch, as PPO's minibatches: the targets and
    # advantages are computed once per pass over the batch (from the weights at its start), then
    # each minibatch learns from steps of every unroll. Feed-forward models only.
    steps = "steps"


class PpoAnchor(enum.Enum):
    """What PPO's clipped surrogate and clipped value loss are taken against (vtrace.ppo_anchor)."""

    # The acting policy and its values (Sample Factory's APPO): with asynchronous actors, weights
    # some updates old, so a batch's ratios start away from 1 and the clip bites early.
    behaviour = "behaviour"
    # The learner's own policy and values at the start of the pass over the batch (the weights the
    # targets came from: PPO's "old" policy), each step weighted by min(rho-bar, anchor/behaviour)
    # for the actors' lag: the decoupled objective of Hilton et al. 2021. optim.minibatch_unit=steps.
    learner = "learner"


class RewardClipping(enum.Enum):
    abs_one = "abs_one"  # to [-1, 1], as in IMPALA on Atari
    none = "none"


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
    trace_lambda: float = 1.0  # lambda in V-trace's traces c_t = lambda * min(1, rho_t); below 1: less variance
    # The policy gradient as PPO's clipped surrogate, with V-trace's targets (Sample Factory's APPO):
    # min(r A, clip(r, 1 - ppo_clip, 1 + ppo_clip) A), r = pi/mu against the behaviour policy and
    # A = r_t + gamma * vs_{t+1} - V(x_t). What makes optim.epochs > 1 safe. null: IMPALA's gradient.
    ppo_clip: Optional[float] = None
    ppo_anchor: PpoAnchor = PpoAnchor.behaviour  # what the ratio and value_clip are taken against (PpoAnchor)
    normalize_advantages: bool = False  # the policy gradient's advantages standardised per minibatch
    # PPO's reward normalisation (gymnasium's NormalizeReward, CleanRL's MuJoCo PPO): rewards (after
    # clipping and reward_scale) divided by a running standard deviation of the discounted return,
    # then clipped to +-reward_norm_clip. The returns are V-trace's targets, in the rewards' units;
    # the statistics live in the learner (checkpointed; the same on mono and poly); the training
    # returns that logs.csv reports stay raw.
    normalize_rewards: bool = False
    reward_norm_clip: float = 10.0
    # PPO's clipped value loss: the larger of the value's squared error and that of the behaviour's
    # value moved at most this far towards it (in units of model.normalize_values' scale, if on).
    # null: the plain squared error.
    value_clip: Optional[float] = None
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
    # Sample reuse: each batch is learned from `epochs` times, each time split into `minibatches`
    # (whole unrolls, by batch column) with one optimiser step each. 1 and 1: IMPALA's one step per batch.
    epochs: int = 1
    minibatches: int = 1
    minibatch_unit: MinibatchUnit = MinibatchUnit.unrolls
    # With minibatch_unit=steps: the targets and advantages computed once per batch, at its first
    # pass, as PPO computes GAE once per rollout (false: anew at each pass, from the weights then).
    targets_once: bool = False
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
class AccelConfig:
    """Speed options (accel.py). Those that change the numbers are off by default, but for bf16
    autocast where it was measured to pay; each is checked against the fp32 result in tests/test_gpu.py."""

    cudnn_benchmark: bool = False  # cuDNN times conv algorithms per input shape and keeps the fastest
    tf32: bool = False  # TF32 matmuls and convolutions on Ampere and later GPUs (10-bit mantissa)
    # The learner's forward pass under bfloat16 autocast (GPU, or CPU); V-trace and the losses stay fp32.
    # null (auto): on for a CPU learner with native bf16 math (AVX512-BF16, AMX) and a conv-heavy
    # model (atari_net, resnet, nethack), where it pays (docs/performance.md#cpu-speed-options); else off.
    bf16_autocast: Optional[bool] = None
    # Acting's forward pass (mono's actors, poly's central inference) under bfloat16 autocast; the
    # heads' outputs, and so the sampled actions and behaviour logits, stay fp32. null: as the learner.
    bf16_acting: Optional[bool] = None
    compile: bool = False  # torch.compile the learner's model (a slow first update: it compiles)
    # Conv weights in channels-last memory format, the layout oneDNN (CPU) and cuDNN convolve fastest:
    # the same math up to rounding; on this project's 2-core CPU box the Pong learner's update
    # takes ~20% less time (docs/performance.md). No effect on models without convolutions.
    channels_last: bool = True
    # One nn.LSTM call per stretch of the unroll between episode starts, rather than one per step:
    # the same math (equal to rounding), one call when no episode ends inside the unroll.
    lstm_segments: bool = True


def check(cfg) -> None:
    """The vtrace and optim slices' checks."""
    vtrace, optim = cfg.vtrace, cfg.optim
    require(0.0 <= vtrace.discounting <= 1.0, "vtrace.discounting must be in [0, 1].")
    for key in ("baseline_cost", "entropy_cost"):
        require(vtrace[key] >= 0, f"vtrace.{key} must be >= 0.")
    require(vtrace.reward_scale > 0, "vtrace.reward_scale must be positive.")
    require(0.0 <= vtrace.trace_lambda <= 1.0, "vtrace.trace_lambda must be in [0, 1].")
    require(vtrace.ppo_clip is None or vtrace.ppo_clip > 0, "vtrace.ppo_clip must be positive or null (off).")
    require(vtrace.reward_norm_clip > 0, "vtrace.reward_norm_clip must be positive.")
    require(vtrace.value_clip is None or vtrace.value_clip > 0, "vtrace.value_clip must be positive or null (off).")
    for key in ("clip_rho_threshold", "clip_pg_rho_threshold"):
        value = vtrace[key]
        require(value is None or value > 0, f"vtrace.{key} must be positive or null (no clipping).")
    for name, term in vtrace.extra_losses.items():
        require(
            isinstance(term, Mapping)
            and set(term) == {"fn", "cost"}
            and isinstance(term["fn"], str)
            and isinstance(term["cost"], (int, float))
            and not isinstance(term["cost"], bool),
            f"vtrace.extra_losses.{name} must be {{fn: module.function, cost: a number}}, e.g. "
            f"+vtrace.extra_losses.{name}={{fn:my_losses.kl_to_behaviour,cost:0.1}}.",
        )
    require(optim.learning_rate > 0, f"optim.learning_rate={optim.learning_rate} must be positive.")
    require(optim.epsilon > 0, "optim.epsilon must be positive.")
    require(optim.grad_norm_clipping > 0, "optim.grad_norm_clipping must be positive.")
    require(optim.epochs >= 1, "optim.epochs must be at least 1.")
    if MinibatchUnit(optim.minibatch_unit) is MinibatchUnit.unrolls:
        require(
            not optim.targets_once,
            "optim.targets_once=true needs optim.minibatch_unit=steps: with whole unrolls the targets are "
            "computed in each minibatch, from the learner's weights then.",
        )
        require(
            1 <= optim.minibatches <= cfg.batch_size,
            f"optim.minibatches={optim.minibatches} must be between 1 and batch_size={cfg.batch_size} "
            "(a minibatch is whole unrolls; optim.minibatch_unit=steps splits by steps).",
        )
    else:
        steps = cfg.batch_size * cfg.unroll_length
        require(
            1 <= optim.minibatches <= steps,
            f"optim.minibatches={optim.minibatches} must be between 1 and the batch's {steps} steps.",
        )
        require(
            not cfg.model.get("use_lstm", False),
            "optim.minibatch_unit=steps needs a feed-forward model: an LSTM learns from whole unrolls "
            "(model.use_lstm=false, or optim.minibatch_unit=unrolls).",
        )
    require(
        PpoAnchor(vtrace.ppo_anchor) is PpoAnchor.behaviour
        or (vtrace.ppo_clip is not None and MinibatchUnit(optim.minibatch_unit) is MinibatchUnit.steps),
        "vtrace.ppo_anchor=learner needs vtrace.ppo_clip and optim.minibatch_unit=steps: the anchor is the "
        "learner at the start of each pass over the batch, which only that pass computes.",
    )
    if OptimName(optim.name) is OptimName.adam:
        require(len(optim.betas) == 2, "optim.betas must have two values, e.g. [0.9,0.999].")
