"""Newest frames only (backends/poly/frame_stacks.py): what the server rebuilds is exactly what
the client's envs returned, through episode ends and envs whose frames do not shift."""

import numpy as np
import pytest

from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.backends.poly.frame_stacks import StackReceiver, StackSender, stackable
from torchbeast_hydra.env import layout
from torchbeast_hydra.env.actions import ActionSpec
from torchbeast_hydra.env.spaces import EnvSpec

from helpers import SMALL, rows, run_cli

FRAMES = (4, 6, 5)  # a stack of 4 frames of 6 x 5
SPEC = EnvSpec.box(FRAMES, np.dtype(np.uint8), ActionSpec.discrete(3))
VECTOR = EnvSpec.box((4,), np.dtype(np.float32), ActionSpec.discrete(3))


def step_outputs(stacks: np.ndarray) -> dict:
    spec = SPEC if stacks.ndim > 2 else VECTOR
    return dict(layout.env_outputs(spec, len(stacks)), frame=stacks)


class StackingEnvs:
    """num_envs stacks of random frames: each step shifts in a new frame, but an env that starts an
    episode (10%) stacks copies of its first frame, and env 2 never shifts (a fresh stack a step)."""

    def __init__(self, num_envs: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.stacks = self.rng.integers(0, 256, (num_envs, *FRAMES), dtype=np.uint8)

    def step(self) -> np.ndarray:
        frames = self.rng.integers(0, 256, (len(self.stacks), *FRAMES[1:]), dtype=np.uint8)
        self.stacks[:, :-1] = self.stacks[:, 1:]  # in place, as an env's own buffer may be
        self.stacks[:, -1] = frames
        starts = self.rng.random(len(self.stacks)) < 0.1
        self.stacks[starts] = frames[starts, None]
        self.stacks[2] = self.rng.integers(0, 256, FRAMES, dtype=np.uint8)
        return self.stacks


@pytest.mark.parametrize("into_rows", [False, True])
def test_the_server_rebuilds_every_stack_the_client_sent_from_fewer_bytes(into_rows):
    envs, sender, receiver = StackingEnvs(5, seed=0), StackSender(), StackReceiver()
    # into_rows: each step's stacks built in the row it goes to, in two sets of 4 rows filled in
    # turn, as the server's unroll rows are (the last step's stacks are then the row before).
    rows = np.zeros((2, 4, 5, *FRAMES), np.uint8)
    stacks, sizes = envs.stacks, []
    for i in range(200):
        raw = wire.encode_step(step_outputs(stacks), stacks=sender)
        out = rows[(i // 4) % 2, i % 4] if into_rows else None
        decoded = wire.decode_step(wire.parse(wire.ClientMessage, raw), 5, SPEC, stacks=receiver, frames_out=out)
        np.testing.assert_array_equal(decoded["frame"], stacks)
        assert (decoded["frame"] is out) == into_rows
        sizes.append(len(raw))
        stacks = envs.step()
    whole = len(wire.encode_step(step_outputs(stacks)))
    # The first step sends every stack; later ones the newest frames of the shifting envs (~3 of 5
    # envs' stacks: env 2 and the ~10% that start an episode go whole).
    assert sizes[0] >= whole
    assert np.mean(sizes[1:]) < 0.7 * whole


def test_a_client_may_send_whole_stacks_and_newest_frames_in_turn():
    stacks = np.random.default_rng(1).integers(0, 256, (2, *FRAMES), dtype=np.uint8)
    receiver = StackReceiver()
    wire.decode_step(wire.parse(wire.ClientMessage, wire.encode_step(step_outputs(stacks))), 2, SPEC, stacks=receiver)
    shifted = np.concatenate([stacks[:, 1:], stacks[:, :1]], axis=1)
    sender = StackSender()
    sender.sent_tail = stacks[:, 1:].copy()
    raw = wire.encode_step(step_outputs(shifted), stacks=sender)
    message = wire.parse(wire.ClientMessage, raw)
    assert list(message.step.frame.shape) == [0, *FRAMES]  # both envs sent their newest frame alone
    np.testing.assert_array_equal(wire.decode_step(message, 2, SPEC, stacks=receiver)["frame"], shifted)


def newest_first(stacks):
    sender = StackSender()
    sender.sent_tail = stacks[:, :-1].copy()  # as if it had sent them, one step older, the step before
    return wire.encode_step(step_outputs(stacks), stacks=sender)


STACKS = np.arange(2 * np.prod(FRAMES), dtype=np.uint8).reshape(2, *FRAMES)


@pytest.mark.parametrize(
    "raw, spec, reason",
    [
        (newest_first(STACKS), SPEC, "newest frames came before any whole stack of frames"),
        (
            wire.encode_step(step_outputs(np.zeros((2, 4), np.float32)), stacks=StackSender()),
            VECTOR,
            "newest frames sent for an observation that is not a stack of frames",
        ),
    ],
)
def test_newest_frames_the_server_cannot_place_are_refused(raw, spec, reason):
    receiver = StackReceiver() if stackable(spec) else None
    with pytest.raises(wire.WireError, match=reason):
        wire.decode_step(wire.parse(wire.ClientMessage, raw), 2, spec, stacks=receiver)


def test_newest_frames_of_the_wrong_shape_or_count_are_refused():
    receiver = StackReceiver()
    wire.decode_step(wire.parse(wire.ClientMessage, wire.encode_step(step_outputs(STACKS))), 2, SPEC, stacks=receiver)
    message = wire.parse(wire.ClientMessage, newest_first(STACKS))
    wire.encode_array(np.zeros((2, 6, 4), np.uint8), message.step.newest)
    with pytest.raises(wire.WireError, match=r"newest: expected uint8 \[2, 6, 5\], got uint8 \[2, 6, 4\]"):
        wire.decode_step(message, 2, SPEC, stacks=receiver)
    message = wire.parse(wire.ClientMessage, newest_first(STACKS))
    wire.encode_array(np.array([True, False]), message.step.newest_only)  # says one env sent a whole stack: none came
    with pytest.raises(wire.WireError, match=r"frame: expected uint8 \[1, 4, 6, 5\], got uint8 \[0, 4, 6, 5\]"):
        wire.decode_step(message, 2, SPEC, stacks=receiver)


def test_only_stacks_of_frames_go_one_frame_at_a_time():
    assert stackable(SPEC)
    assert not stackable(VECTOR)
    assert not stackable(EnvSpec.box((1, 6, 5), np.dtype(np.uint8), 3))  # one frame


@pytest.mark.slow
def test_a_pong_run_over_grpc_trains_with_newest_frames_on_by_default(tmp_path):
    run_dir = tmp_path / "run"
    run_cli(run_dir, "env=pong", "backend=poly", "backend.local_transport=grpc", "total_steps=512", *SMALL, timeout=300)
    assert int(rows(run_dir)[-1]["step"]) >= 512
