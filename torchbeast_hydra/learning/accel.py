"""Speed options for the learner and acting (`accel:` in the config, config.AccelConfig).

Process-wide switches (cudnn.benchmark, TF32) are set once at start; bf16 autocast wraps the
model's forward pass only, whose outputs are fp32, so V-trace and the losses are computed in fp32
(left at null, it is on where it was measured to pay: `uses_bf16`, and acting follows: `acts_in_bf16`);
torch.compile wraps the learner's model, whose parameters (and checkpoints) stay those of the
plain module; channels_last changes only how the conv weights are laid out in memory.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def apply_switches(cfg) -> None:
    """cudnn.benchmark and TF32, process-wide (the learner's process); no effect on a CPU."""
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX), where oneDNN's bf16
    convolutions run faster than float32's; elsewhere bf16 is emulated and gains nothing."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's, private
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def uses_bf16(cfg, device: torch.device, model: nn.Module) -> bool:
    """accel.bf16_autocast, or (null: auto) whether it pays here: a CPU learner with native bf16
    math, for a model whose body declares that convolutions dominate its cost (Body.bf16_on_cpu:
    atari_net, resnet, nethack). There the Pong learner's update takes a third less time (docs/performance.md);
    a GPU learner, or an MLP's, keeps float32 unless asked."""
    if cfg.bf16_autocast is not None:
        return cfg.bf16_autocast
    return device.type == "cpu" and getattr(model.body, "bf16_on_cpu", False) and native_bf16()


def acts_in_bf16(cfg, learner_bf16: bool) -> bool:
    """accel.bf16_acting, or (null) as the learner computes: acting runs the same convolutions on
    batches of a few envs, where bf16 pays as it does for the learner (docs/performance.md)."""
    return learner_bf16 if cfg.bf16_acting is None else cfg.bf16_acting


def autocast(bf16: bool, device: torch.device):
    """The context a forward pass runs in: bf16 autocast (the learner's: uses_bf16; acting's:
    acts_in_bf16), or nothing. One context a pass: autocast keeps its bf16 copies of the weights
    until its context ends."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def float_limit(bf16: bool) -> float:
    """The largest magnitude an observation may hold: beyond it the dtype the model computes in makes
    it inf. That is bf16 where the learner's or acting's pass runs under bf16 autocast (uses_bf16,
    acts_in_bf16), else float32."""
    return float(torch.finfo(torch.bfloat16 if bf16 else torch.float32).max)


def forward_fn(cfg, model: nn.Module):
    """What the learner calls for its forward pass: the model (its conv weights channels-last if
    asked), compiled if asked."""
    model.lstm_segments = cfg.lstm_segments
    if cfg.channels_last:  # converts the conv weights in place: the optimiser's parameters stay the same
        model.to(memory_format=torch.channels_last)
    return torch.compile(model) if cfg.compile else model
