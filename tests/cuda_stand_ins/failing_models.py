"""A model body that fails like a GPU can, in the learner process, after a number of calls.

Configured by environment variables (so that the model config keeps MLPBody's fields):
TBH_FAIL_AFTER: calls that succeed first (default 0); TBH_FAIL_IN: which calls count and fail,
"inference" (no grad: central inference and the start-up checks) or "update" (the learner's
forward pass); TBH_FAIL_WITH: "bug" (a ValueError), "oom" (CUDA out of memory) or "assert"
(a device-side assert, as torch raises it).
"""

import multiprocessing
import os

import torch

from torchbeast_hydra.agent.models import MLPBody

ERRORS = {
    "bug": lambda: ValueError("a bug in the model: shapes (4, 64) and (65, 64) do not match"),
    "oom": lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "assert": lambda: getattr(torch, "AcceleratorError", RuntimeError)("CUDA error: device-side assert triggered"),
}


class FailingBody(MLPBody):
    def __init__(self, obs_shape, **mlp_fields):
        super().__init__(obs_shape, **mlp_fields)
        self.calls = 0

    def forward(self, frames):
        in_learner = multiprocessing.parent_process() is None
        counted = torch.is_grad_enabled() == (os.environ.get("TBH_FAIL_IN", "inference") == "update")
        if in_learner and counted:
            self.calls += 1
            if self.calls > int(os.environ.get("TBH_FAIL_AFTER", "0")):
                raise ERRORS[os.environ.get("TBH_FAIL_WITH", "bug")]()
        return super().forward(frames)
