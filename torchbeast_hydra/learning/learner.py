"""The learning math, shared by every backend: V-trace targets, IMPALA losses, one optimiser step.

A batch is a dict of tensors [T+1, B, ...] on the learner's device. Row 0 repeats the last row of
the previous unroll. Row t+1 holds the env's response (frame, reward, done) to the action taken
at row t, together with that action and the behaviour policy's logits; so the learning math uses
rows 1..T of the batch against the learner's outputs for rows 0..T-1, and the learner's value at
row T bootstraps the return. `mask` (rows 1..T) marks real steps; partial rollouts are padded.

The learning math never asks which action space it is: the action distribution (distributions.py,
the model's `dist`) scores actions, and V-trace's importance weights are log-probability
differences, log rho = log pi(a|x) - log mu(a|x), summed over an action's independent dimensions.

The loss is a dict of named terms (pg_loss, baseline_loss, entropy_loss, and yours from
vtrace.extra_losses), each a function of `LossInputs` times its cost; the learner sums them and
logs each one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import hydra
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.profiler import record_function

from torchbeast_hydra.agent.distributions import Distribution, distribution
from torchbeast_hydra.agent.models import RunningNorm, ValueNorm
from torchbeast_hydra.env.actions import ActionSpec
from torchbeast_hydra.errors import ConfigError
from torchbeast_hydra.learning import accel, vtrace
from torchbeast_hydra.learning.policy_lag import divergence
from torchbeast_hydra.learning.settings import (
    MinibatchUnit,
    OnNonFinite,
    OptimConfig,
    OptimName,
    PpoAnchor,
    RewardClipping,
    VtraceConfig,
)

log = logging.getLogger(__name__)


@dataclass
class LossInputs:
    """What a loss term sees: the batch's steps, the learner's outputs on them, the V-trace targets.

    steps: the batch's rows 1..T ([T, B, ...]: reward, done, action, the behaviour policy's
    policy_logits, ...); outputs: the learner's forward pass on rows 0..T-1 (policy_logits,
    baseline) and bootstrap_value its baseline at row T; rewards: clipped and scaled as
    configured; mask: 1.0 on real steps, 0.0 on padding (multiply every per-step term by it);
    dist: the action distribution (log_prob, entropy, kl of policy_logits; distributions.py);
    value_scale: the value targets' scale with model.normalize_values (PopArt), else 1: the value
    loss and the advantages are in units of it. return_std: what the rewards were divided by
    (vtrace.normalize_rewards), else 1. anchor_log_probs, anchor_values: what PPO's clipped
    surrogate and value loss are taken against (vtrace.ppo_anchor: the behaviour's by default),
    and anchor_weights each step's importance weight from the behaviour to that anchor (else 1).
    """

    cfg: VtraceConfig
    steps: dict
    outputs: dict
    bootstrap_value: torch.Tensor
    rewards: torch.Tensor
    mask: torch.Tensor
    targets: vtrace.VTraceReturns
    dist: Distribution
    log_probs: torch.Tensor
    behaviour_log_probs: torch.Tensor
    advantages: torch.Tensor
    value_scale: torch.Tensor | float = 1.0
    return_std: torch.Tensor | float = 1.0
    anchor_log_probs: torch.Tensor | None = None
    anchor_values: torch.Tensor | None = None
    anchor_weights: torch.Tensor | float = 1.0

    def __post_init__(self):
        if self.anchor_log_probs is None:
            self.anchor_log_probs = self.behaviour_log_probs
        if self.anchor_values is None:
            self.anchor_values = self.steps.get("baseline")  # the acting policy's values of the same states


# A loss term: LossInputs -> a scalar tensor (summed over time and batch, as in TorchBeast).
LossTerm = Callable[[LossInputs], torch.Tensor]


def policy_gradient_term(inputs: LossInputs) -> torch.Tensor:
    """IMPALA's policy gradient, or with vtrace.ppo_clip PPO's clipped surrogate on pi over its
    anchor (the behaviour policy, or with vtrace.ppo_anchor=learner the learner's at the pass's start)."""
    advantages, clip = inputs.advantages.detach(), inputs.cfg.ppo_clip
    if clip is None:
        return -(inputs.log_probs * advantages * inputs.mask).sum()
    ratio = torch.exp(inputs.log_probs - inputs.anchor_log_probs)
    surrogate = torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages) * inputs.anchor_weights
    # where(), not a product: a padded step's ratio may be inf, and inf * 0 is NaN.
    return -torch.where(inputs.mask > 0, surrogate, torch.zeros_like(surrogate)).sum()


def baseline_term(inputs: LossInputs) -> torch.Tensor:
    """The value's squared error; with vtrace.value_clip, PPO's clipped value loss: the larger of it
    and the squared error of the anchor's value (vtrace.ppo_anchor) moved at most value_clip towards
    the learner's."""
    values, targets, scale = inputs.outputs["baseline"], inputs.targets.vs, inputs.value_scale
    errors = (targets - values) / scale
    clip = inputs.cfg.value_clip
    if clip is not None:
        anchor = inputs.anchor_values
        clipped = anchor + (values - anchor).clamp(-clip * scale, clip * scale)
        errors = torch.maximum(errors.abs(), ((targets - clipped) / scale).abs())
    return 0.5 * ((errors**2) * inputs.mask).sum()


def entropy_term(inputs: LossInputs) -> torch.Tensor:
    return -(inputs.dist.entropy(inputs.outputs["policy_logits"]) * inputs.mask).sum()


def policy_entropy(inputs: LossInputs, losses: dict, cost: float) -> torch.Tensor:
    """The learner policy's mean entropy over the real steps, logged whatever entropy_cost: its
    collapse, or a Gaussian's spread that will not shrink, shows here first. Read off the weighted
    entropy loss where it has a cost, so that it is computed once a step either way."""
    with torch.no_grad():
        term = losses["entropy_loss"] / cost if cost else entropy_term(inputs)
        return -term / inputs.mask.sum().clamp(min=1)


# IMPALA's terms: name -> (term, the vtrace config field holding its cost; None: cost 1).
BUILTIN_TERMS = {
    "pg_loss": (policy_gradient_term, None),
    "baseline_loss": (baseline_term, "baseline_cost"),
    "entropy_loss": (entropy_term, "entropy_cost"),
}


def _stage(name: str):
    """A torch.profiler scope for a stage of the learner's step (benchmarks/_stages.py reads them),
    entered only while a profiler records: otherwise each costs ~7 us, and APPO's presets take 80
    optimiser steps an update."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def loss_terms(cfg: VtraceConfig) -> dict:
    """name -> (term, cost): IMPALA's terms, then vtrace.extra_losses (yours, by import path)."""
    terms = {
        name: (term, 1.0 if field is None else getattr(cfg, field)) for name, (term, field) in BUILTIN_TERMS.items()
    }
    for name, extra in (getattr(cfg, "extra_losses", None) or {}).items():
        if name in terms or name == "total_loss" or not name.endswith("_loss"):
            raise ConfigError(
                f"vtrace.extra_losses.{name}: name extra terms <something>_loss, "
                f"other than total_loss and {', '.join(BUILTIN_TERMS)}."
            )
        try:
            term = hydra.utils.get_method(extra["fn"])
        except Exception as error:
            raise ConfigError(
                f"vtrace.extra_losses.{name}.fn={extra['fn']!r} is not an importable "
                f"function (module.function): {error}"
            ) from error
        terms[name] = (term, float(extra["cost"]))
    return terms


def compute_losses(
    cfg: VtraceConfig, batch: dict, outputs: dict, terms: dict | None = None, dist: Distribution | None = None
) -> dict:
    """The loss terms (each times its cost) and their sum, total_loss (to differentiate).

    batch: the rollouts [T+1, B, ...]; outputs: the learner's forward pass over them; terms:
    loss_terms(cfg), resolved once by the caller (default: resolved here); dist: the model's
    action distribution (default: a categorical over policy_logits, a Discrete space).
    """
    return weighted_losses(loss_inputs(cfg, batch, outputs, dist), loss_terms(cfg) if terms is None else terms)


def weighted_losses(inputs: LossInputs, terms: dict) -> dict:
    """Each term of `terms` (loss_terms) on the inputs times its cost, and their sum, total_loss.
    A term whose cost is 0 is not computed (it is 0: say entropy_cost=0, MuJoCo's)."""
    zero = inputs.mask.new_zeros(())
    losses = {name: cost * term(inputs) if cost else zero for name, (term, cost) in terms.items()}
    return dict(total_loss=sum(losses.values()), **losses)


def loss_inputs(
    cfg: VtraceConfig,
    batch: dict,
    outputs: dict,
    dist: Distribution | None = None,
    value_scale: torch.Tensor | float = 1.0,
    return_std: torch.Tensor | float = 1.0,
) -> LossInputs:
    """Aligns rows (learner outputs 0..T-1 against batch rows 1..T) and computes V-trace targets.
    return_std: the rewards' divisor with vtrace.normalize_rewards (Learner.return_std)."""
    if dist is None:
        dist = distribution(ActionSpec.discrete(outputs["policy_logits"].shape[-1]))
    bootstrap_value = outputs["baseline"][-1]
    steps = {key: value[1:] for key, value in batch.items()}
    outputs = {key: value[:-1] for key, value in outputs.items()}
    mask = steps["mask"].float()

    rewards = steps["reward"]
    if RewardClipping(cfg.reward_clipping) is RewardClipping.abs_one:
        rewards = rewards.clamp(-1, 1)
    if cfg.reward_scale != 1.0:
        rewards = rewards * cfg.reward_scale
    if cfg.normalize_rewards:
        rewards = (rewards / return_std).clamp(-cfg.reward_norm_clip, cfg.reward_norm_clip)
    discounts = (~steps["done"]).float() * cfg.discounting

    behavior_log_probs = dist.log_prob(steps["policy_logits"], steps["action"])
    target_log_probs = dist.log_prob(outputs["policy_logits"], steps["action"])
    # A zero importance weight on padding zeroes its TD errors, so nothing flows back from it
    # into the targets of real steps (the last real value still bootstraps them).
    log_rhos = (target_log_probs - behavior_log_probs).masked_fill(mask == 0, -math.inf)
    targets = vtrace.from_importance_weights(
        log_rhos=log_rhos,
        discounts=discounts,
        rewards=rewards,
        values=outputs["baseline"],
        bootstrap_value=bootstrap_value,
        clip_rho_threshold=cfg.clip_rho_threshold,
        clip_pg_rho_threshold=cfg.clip_pg_rho_threshold,
        trace_lambda=cfg.trace_lambda,
    )
    advantages = targets.pg_advantages
    if cfg.ppo_clip is not None:  # the surrogate's ratio does the importance weighting
        vs_next = torch.cat([targets.vs[1:], bootstrap_value.detach().unsqueeze(0)])
        advantages = (rewards + discounts * vs_next - outputs["baseline"].detach()) * mask
    if cfg.normalize_advantages:
        advantages = standardised(advantages, mask)
    else:
        advantages = advantages / value_scale  # PopArt's: in units of the targets' scale
    return LossInputs(
        cfg, steps, outputs, bootstrap_value, rewards, mask, targets, dist,
        log_probs=target_log_probs, behaviour_log_probs=behavior_log_probs, advantages=advantages,
        value_scale=value_scale, return_std=return_std,
    )  # fmt: skip


def lag_weights(anchor: torch.Tensor, behaviour: torch.Tensor, rho_bar: float | None) -> torch.Tensor:
    """Each step's importance weight from the behaviour policy to the anchor (their log-probs of the
    action taken), clipped at rho_bar as V-trace's policy gradient clips it: vtrace.ppo_anchor=learner's
    correction for the actors' lag."""
    weights = torch.exp(anchor - behaviour).detach()
    return weights if rho_bar is None else weights.clamp(max=rho_bar)


def target_moments(targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[mean, mean square] of the value targets over the real steps (ValueNorm.update's input)."""
    count = mask.sum().clamp(min=1)
    return torch.stack([(targets * mask).sum() / count, (targets.pow(2) * mask).sum() / count])


def standardised(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values with zero mean and unit variance over the real steps (padding stays 0)."""
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    std = (((values - mean) * mask).pow(2).sum() / count).sqrt()
    return (values - mean) / (std + 1e-8) * mask


def make_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    if OptimName(cfg.name) is OptimName.rmsprop:
        optimizer = torch.optim.RMSprop(
            params, lr=cfg.learning_rate, alpha=cfg.alpha, eps=cfg.epsilon, momentum=cfg.momentum, foreach=True
        )
        start_square_avg(optimizer, cfg.initial_square_avg)
        return optimizer
    # foreach: one call per operation for all the parameters, also on the CPU (torch only defaults to it
    # on GPUs); the same numbers, a third of the optimiser's time on a small model.
    return torch.optim.Adam(params, lr=cfg.learning_rate, betas=tuple(cfg.betas), eps=cfg.epsilon, foreach=True)


def start_square_avg(optimizer: torch.optim.RMSprop, value: float) -> None:
    """Starts RMSProp's mean of squared gradients at `value` (torch starts it at 0 on the first step;
    state already present is used as it is). A checkpoint's state replaces this on resume."""
    if value == 0:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["square_avg"] = torch.full_like(param, value, memory_format=torch.preserve_format)
            if group["momentum"] > 0:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group["centered"]:
                state["grad_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def make_scheduler(cfg: OptimConfig, optimizer, steps_done, total_steps: int):
    """Linear annealing to zero at total_steps (TorchBeast's schedule), or a constant rate.

    steps_done() returns the env steps learned from so far: counting steps rather than updates
    keeps the schedule right when partial rollouts make updates of different sizes.
    """
    if not cfg.anneal_lr:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: max(0.0, 1.0 - steps_done() / total_steps))


def minibatches(batch: dict, core_state: tuple, count: int, shuffle: bool):
    """The batch (and the core state it starts from) split by columns, whole unrolls, into `count`
    parts (their sizes differ by one at most), in a random order when shuffle; count=1: the batch
    itself, uncopied."""
    if count == 1:
        yield batch, core_state
        return
    size, device = batch["done"].shape[1], batch["done"].device
    order = torch.randperm(size, device=device) if shuffle else torch.arange(size, device=device)
    for columns in order.tensor_split(count):  # not chunk(): 5 columns in 4 would make 3 parts
        yield {key: value[:, columns] for key, value in batch.items()}, tuple(s[:, columns] for s in core_state)


@contextlib.contextmanager
def frozen(norms: list):
    """Running statistics (RunningNorm, ValueNorm) that do not update meanwhile."""
    for norm in norms:
        norm.frozen = True
    try:
        yield
    finally:
        for norm in norms:
            norm.frozen = False


# The settings an update reads afresh each time, so a running learner can take new values
# (Learner.set_hyperparameters; population-based training mutates them). Every other setting shapes
# the model, the batch or the optimiser's state and holds for the whole run.
LIVE_KEYS = (
    "optim.learning_rate",  # the LR schedule follows it: the same annealing factor times the new rate
    "optim.epsilon",
    "optim.grad_norm_clipping",
    "vtrace.discounting",
    "vtrace.baseline_cost",
    "vtrace.entropy_cost",
    "vtrace.reward_scale",
    "vtrace.trace_lambda",
    "vtrace.clip_rho_threshold",
    "vtrace.clip_pg_rho_threshold",
    "vtrace.ppo_clip",
)


class NonFiniteUpdate(RuntimeError):
    """A NaN/inf loss or gradient with optim.on_nonfinite=stop."""


class Learner:
    """The model being trained, its optimiser and LR schedule, and one update on a batch."""

    def __init__(
        self,
        cfg,
        model: nn.Module,
        device: torch.device,
        average_gradients: Callable | None = None,
        sum_over_ranks: Callable | None = None,
    ):
        """With several data-parallel ranks (launch/distributed.py; None with one rank):
        average_gradients(parameters, figures) replaces the gradients and the figures (the loss
        terms) by their mean over the ranks, in place; sum_over_ranks(tensor) by their sum, for the
        observation statistics (RunningNorm)."""
        self.cfg = cfg
        self.average_gradients = average_gradients
        self.device = device
        self.model = model.to(device)
        self.forward = accel.forward_fn(cfg.accel, self.model)  # shares the model's parameters
        self.bf16 = accel.uses_bf16(cfg.accel, device, self.model)  # the forward pass under bf16 autocast
        self.optimizer = make_optimizer(cfg.optim, model.parameters())
        self.steps = 0  # env steps learned from (real steps: the mask's count)
        # Updates made (calls of update()) in this process: the version of the weights they give
        # (WeightPublisher.version), from which policy lag is counted (policy_lag.py).
        self.updates = 0
        self.scheduler = make_scheduler(cfg.optim, self.optimizer, lambda: self.steps, cfg.total_steps)
        self.skipped_updates = 0
        self.loss_terms = loss_terms(cfg.vtrace)  # a bad vtrace.extra_losses fails here, before acting
        # The losses read these settings on every step: a plain object's attributes are ~50x faster
        # to read than a DictConfig's, which shows once optim.epochs x minibatches steps are small.
        self.vtrace_cfg = OmegaConf.to_object(cfg.vtrace) if OmegaConf.is_config(cfg.vtrace) else cfg.vtrace
        self.running_norms = [m for m in self.model.modules() if isinstance(m, (RunningNorm, ValueNorm))]
        for norm in self.running_norms:
            if isinstance(norm, RunningNorm):
                norm.sum_over_ranks = sum_over_ranks
        self.value_norm: ValueNorm | None = getattr(self.model, "value_norm", None)
        # vtrace.normalize_rewards: running moments of the discounted return (V-trace's targets in the
        # rewards' units), the learner's own; each sample counts once, as the model's statistics.
        self.return_norm: RunningNorm | None = None
        if self.vtrace_cfg.normalize_rewards:
            self.return_norm = RunningNorm(1).to(device)
            self.return_norm.sum_over_ranks = sum_over_ranks
            self.running_norms.append(self.return_norm)
        # The targets and advantages of optim.minibatch_unit=steps: raw, standardised per minibatch.
        self._targets_cfg = dataclasses.replace(self.vtrace_cfg, normalize_advantages=False)
        self.parameters = list(self.model.parameters())

    def update(self, batch: dict, initial_core_state: tuple, steps: int | None = None) -> dict:
        """Learns from a batch: optim.epochs passes, each of optim.minibatches optimiser steps on
        whole unrolls (one step by default, IMPALA's); returns floats for logging, the figures
        averaged over the steps. Non-finite steps are skipped.

        steps: the batch's real steps, when the caller counted them on the CPU copy (on a GPU,
        counting them here would wait for the device)."""
        self.steps += int(batch["mask"][1:].sum()) if steps is None else steps
        self.model.train()
        optim = self.cfg.optim
        figures = []
        by_steps = MinibatchUnit(optim.minibatch_unit) is MinibatchUnit.steps
        whole = None
        for epoch in range(optim.epochs):
            # Running statistics (observations, value targets) count each sample once.
            with frozen(self.running_norms if epoch > 0 else []):
                if by_steps:
                    if whole is None or not optim.targets_once:
                        whole = self._batch_targets(batch, initial_core_state)
                    parts = self._step_minibatches(batch, whole)
                else:
                    parts = (
                        partial(self._unroll_inputs, part, state)
                        for part, state in minibatches(
                            batch, initial_core_state, optim.minibatches, shuffle=optim.epochs > 1
                        )
                    )
                for inputs_of in parts:
                    figures.append(self._step(inputs_of))
        self.scheduler.step()
        self.updates += 1
        stats = {name: sum(values) / len(values) for name, values in zip(self._figure_names, zip(*figures))}
        stats["learning_rate"] = self.scheduler.get_last_lr()[0]
        if self.return_norm is not None:
            stats["return_std"] = float(self.return_std())
        return stats

    def return_std(self) -> torch.Tensor | float:
        """What vtrace.normalize_rewards divides the rewards by: the discounted return's running
        standard deviation (1 before any batch; 1 without the option)."""
        if self.return_norm is None:
            return 1.0
        return torch.sqrt(self.return_norm.var + self.return_norm.epsilon).float()

    def _unroll_inputs(self, batch: dict, initial_core_state: tuple, value_scale) -> LossInputs:
        """The learner's forward pass over whole unrolls and their V-trace targets."""
        with _stage("learner/forward"), accel.autocast(self.bf16, self.device):
            outputs, _ = self.forward(batch, initial_core_state, action="none")
        with _stage("learner/losses"):
            return loss_inputs(self.vtrace_cfg, batch, outputs, self.model.dist, value_scale, self.return_std())

    def _batch_targets(self, batch: dict, initial_core_state: tuple) -> LossInputs:
        """optim.minibatch_unit=steps: the whole batch's targets and raw advantages, from one forward
        pass (no gradient; V-trace needs whole unrolls), at the start of each pass over the batch or,
        with optim.targets_once, of the first."""
        with torch.no_grad(), _stage("learner/targets"), accel.autocast(self.bf16, self.device):
            outputs, _ = self.forward(batch, initial_core_state, action="none")
            return loss_inputs(self._targets_cfg, batch, outputs, self.model.dist, return_std=self.return_std())

    def _step_minibatches(self, batch: dict, whole: LossInputs):
        """optim.minibatch_unit=steps: one pass's minibatches of single steps, drawn at random from
        the batch's real steps, each as a function of the value scale giving its LossInputs, with
        `whole`'s targets (_batch_targets)."""
        count = self.cfg.optim.minibatches
        real = whole.mask.flatten().nonzero().flatten()
        order = real[torch.randperm(len(real), device=real.device)]
        if 0 < len(order) < count:
            # Mostly padding (partial rollouts): some steps twice, so that every batch takes `count`
            # optimiser steps; with several ranks their gradient all_reduces must pair up.
            order = order.repeat(-(-count // len(order)))[:count]
        for steps in order.tensor_split(count):
            yield partial(self._steps_inputs, batch, whole, steps)

    def _steps_inputs(self, batch: dict, whole: LossInputs, steps: torch.Tensor, value_scale) -> LossInputs:
        """LossInputs of some steps of a batch (flat indices t * B + b into its rows 1..T), as a
        batch [1, n]: the learner's forward pass on their input rows, `whole`'s targets for them."""
        columns = whole.mask.shape[1]
        t, b = steps // columns, steps % columns

        def pick(values: torch.Tensor) -> torch.Tensor:
            return values[t, b].unsqueeze(0)

        rows = {key: pick(value[:-1]) for key, value in batch.items()}  # the model's input rows 0..T-1
        with _stage("learner/forward"), accel.autocast(self.bf16, self.device):
            outputs, _ = self.forward(rows, (), action="none")
        taken = {key: pick(value) for key, value in whole.steps.items()}
        advantages = pick(whole.advantages)
        mask = torch.ones_like(advantages)
        if self.vtrace_cfg.normalize_advantages:
            advantages = standardised(advantages, mask)
        else:
            advantages = advantages / value_scale
        behaviour_log_probs = pick(whole.behaviour_log_probs)
        anchor = {}
        if PpoAnchor(self.vtrace_cfg.ppo_anchor) is PpoAnchor.learner:  # the learner at the pass's start
            start = pick(whole.log_probs)
            anchor = dict(
                anchor_log_probs=start,
                anchor_values=pick(whole.outputs["baseline"]),
                anchor_weights=lag_weights(start, behaviour_log_probs, self.vtrace_cfg.clip_pg_rho_threshold),
            )
        return LossInputs(
            self.vtrace_cfg, taken, outputs, whole.bootstrap_value, pick(whole.rewards), mask,
            vtrace.VTraceReturns(vs=pick(whole.targets.vs), pg_advantages=pick(whole.targets.pg_advantages)),
            whole.dist, log_probs=whole.dist.log_prob(outputs["policy_logits"], taken["action"]),
            behaviour_log_probs=behaviour_log_probs, advantages=advantages, value_scale=value_scale,
            return_std=whole.return_std, **anchor,
        )  # fmt: skip

    def _step(self, inputs_of: Callable) -> list:
        """One optimiser step on (part of) a batch; its figures (the loss terms, the grad norm).
        inputs_of(value_scale): the part's LossInputs, from the learner's forward pass on it."""
        value_norm = self.value_norm
        value_scale = value_norm.std.float() if value_norm is not None else 1.0
        inputs = inputs_of(value_scale)
        with _stage("learner/losses"):
            losses = weighted_losses(inputs, self.loss_terms)
            apart = divergence(inputs)  # how far the behaviour policy is from this one
            apart["policy_entropy"] = policy_entropy(inputs, losses, self.loss_terms["entropy_loss"][1])
        with _stage("learner/backward"):
            self.optimizer.zero_grad(set_to_none=True)
            losses["total_loss"].backward()
        names = [*losses, *apart]
        figures = torch.stack([*losses.values(), *apart.values()]).detach()
        updates_norm = value_norm is not None and not value_norm.frozen
        if updates_norm:  # the targets' moments ride along: with several ranks, averaged with the rest
            figures = torch.cat([figures, target_moments(inputs.targets.vs.detach(), inputs.mask)])
        if self.average_gradients is not None:  # every rank steps with the same (mean) gradient
            with _stage("learner/all_reduce"):
                self.average_gradients(self.parameters, figures)
        with _stage("learner/optimiser"):
            result, stepped = self._optimiser_step(names, figures[: len(names)])
        if updates_norm and stepped:  # after the step: its gradient was in the scale it was taken at
            value_norm.update(*figures[len(names) :], head=self.model.baseline)
        if self.return_norm is not None:  # the returns in the rewards' units (each sample once: see frozen)
            real = inputs.mask.flatten() > 0
            self.return_norm.observe((inputs.targets.vs.detach() * inputs.return_std).flatten()[real].unsqueeze(1))
        return result

    def _optimiser_step(self, names: list, figures: torch.Tensor) -> tuple[list, bool]:
        """Clips the gradient and steps, unless the loss or the gradient is not finite; the figures
        (named `names`, total_loss first), and whether it stepped."""
        grad_norm = nn.utils.clip_grad_norm_(self.parameters, self.cfg.optim.grad_norm_clipping)
        self._figure_names = [*names, "grad_norm"]
        # One device-to-host copy for all the figures: on a GPU each .item() would wait on its own.
        figures = torch.cat([figures, grad_norm.detach().reshape(1)]).tolist()
        stepped = math.isfinite(figures[0]) and math.isfinite(figures[-1])  # total_loss and grad_norm
        if stepped:
            self.optimizer.step()
        elif OnNonFinite(self.cfg.optim.on_nonfinite) is OnNonFinite.stop:
            raise NonFiniteUpdate(
                f"non-finite loss or gradient ({dict(zip(self._figure_names, figures))}); the weights were "
                "not updated. Look for NaN/inf rewards or observations, or lower optim.learning_rate; "
                "optim.on_nonfinite=skip skips such updates instead."
            )
        else:
            self.skipped_updates += 1
            log.warning(
                "Skipped an update with a non-finite loss or gradient: %s", dict(zip(self._figure_names, figures))
            )
        return figures, stepped

    def state_dict(self) -> dict:
        state = dict(
            model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            steps=self.steps,
        )
        if self.return_norm is not None:
            state["return_norm"] = self.return_norm.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.return_norm is not None and "return_norm" in state:  # else (a run without it): fresh statistics
            self.return_norm.load_state_dict(state["return_norm"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]
        self._apply_config_hyperparameters()

    def hyperparameters(self, keys) -> dict:
        """The values this learner uses now for these LIVE_KEYS."""
        return {key: getattr(getattr(self.cfg, group), name) for key in keys for group, _, name in [key.partition(".")]}

    def set_hyperparameters(self, values: dict) -> None:
        """Takes new values of LIVE_KEYS (dotted key -> number) from the next update on. Call it
        between updates (TrainingRun's lock). The learner keeps them in a config of its own: the run's
        config, and so its checkpoint's `config`, stay as the run was started."""
        unknown = sorted(set(values) - set(LIVE_KEYS))
        if unknown:
            raise ConfigError(f"{', '.join(unknown)} cannot change during a run; these can: {', '.join(LIVE_KEYS)}.")
        if not getattr(self, "_own_cfg", False):  # copied once: the run's config stays as started
            self.cfg = copy.deepcopy(self.cfg)
            self._own_cfg = True
        for key, value in values.items():
            group, _, name = key.partition(".")
            setattr(getattr(self.cfg, group), name, value)
            if group == "vtrace":
                setattr(self.vtrace_cfg, name, value)
        self.loss_terms = loss_terms(self.vtrace_cfg)  # the costs are read when the terms are resolved
        self._targets_cfg = dataclasses.replace(self.vtrace_cfg, normalize_advantages=False)
        self._apply_config_hyperparameters()

    def _apply_config_hyperparameters(self) -> None:
        """The config's optimiser settings over the checkpoint's, and the LR schedule re-derived from
        them: a run resumed with a new learning rate, epsilon or total_steps uses the new values
        (resume.py lists the changes), while the optimiser's running state carries over."""
        configured = make_optimizer(self.cfg.optim, [torch.zeros(1)]).param_groups[0]
        settings = {key: value for key, value in configured.items() if key != "params"}
        lr = self.cfg.optim.learning_rate
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group.update(settings, initial_lr=lr, lr=lr * factor)
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
