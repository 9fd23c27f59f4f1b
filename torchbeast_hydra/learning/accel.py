"""Speed options for the learner (`accel:` in the config, config.AccelConfig).

Process-wide switches (cudnn.benchmark, TF32) are set once at start; bf16 autocast wraps the
model's forward pass only, so V-trace and the losses are computed in fp32 from its outputs;
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


def autocast(cfg, device: torch.device):
    """The context the learner's forward pass runs in: bf16 autocast, or nothing."""
    if not cfg.bf16_autocast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def compute_dtype(cfg) -> torch.dtype:
    """The float dtype the model computes in: bf16 under bf16_autocast (the learner's pass; acting runs
    in float32, whose range bf16 all but shares), else float32."""
    return torch.bfloat16 if cfg.bf16_autocast else torch.float32


def float_limit(cfg) -> float:
    """The largest magnitude an observation may hold: beyond it the model's compute dtype makes it inf."""
    return float(torch.finfo(compute_dtype(cfg)).max)


def forward_fn(cfg, model: nn.Module):
    """What the learner calls for its forward pass: the model (its conv weights channels-last if
    asked), compiled if asked."""
    model.lstm_segments = cfg.lstm_segments
    if cfg.channels_last:  # converts the conv weights in place: the optimiser's parameters stay the same
        model.to(memory_format=torch.channels_last)
    return torch.compile(model) if cfg.compile else model
