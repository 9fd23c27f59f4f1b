"""The rollout layout is declared once: env outputs, shared buffers, the wire's step and the
learner's specs all follow it."""

import numpy as np
import torch

from torchbeast_hydra.backends.mono.backend import create_buffers
from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.env import layout
from torchbeast_hydra.env.settings import EnvConfig
from torchbeast_hydra.env.spaces import EnvSpec
from torchbeast_hydra.env.vector import Environments

SPEC = EnvSpec.box((4, 84, 84), np.dtype(np.uint8), 6)


def test_specs_resolve_the_env_spaces():
    specs = layout.rollout_specs(SPEC)
    assert list(specs) == list(layout.LAYOUT)
    assert specs["frame"] == ((4, 84, 84), torch.uint8)
    assert specs["policy_logits"] == ((6,), torch.float32)
    assert specs["mask"] == ((), torch.bool)


def test_every_consumer_derives_its_keys_from_the_layout():
    envs = Environments(EnvConfig(id="CartPole-v1"), 2, seed=0)
    try:
        out = envs.initial()
        assert list(out) == list(layout.ENV_KEYS)
        for key, (shape, dtype) in layout.numpy_specs(envs.spec, layout.ENV).items():
            assert out[key].shape == (2, *shape) and out[key].dtype == dtype, key
    finally:
        envs.close()
    assert wire.STEP_KEYS == layout.ENV_KEYS
    # obs: Dict/Tuple leaves; newest_only, newest: a stack of frames a frame at a time (frame_stacks.py)
    assert [f.name for f in wire.Step.DESCRIPTOR.fields] == [*layout.ENV_KEYS, "obs", "newest_only", "newest"]
    buffers = create_buffers(SPEC, unroll_length=5, count=3)
    assert set(buffers) == set(layout.LAYOUT)
    assert buffers["policy_logits"].shape == (6, 3, 6) and buffers["frame"].dtype == torch.uint8
    assert set(layout.ENV_KEYS) | set(layout.AGENT_KEYS) | {"mask"} == set(layout.LAYOUT)
