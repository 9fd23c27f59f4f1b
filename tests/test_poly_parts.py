"""The poly backend's parts: the wire format, the dynamic batcher, unroll assembly."""

import math
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from torchbeast_hydra.backends.poly import backend as poly_backend
from torchbeast_hydra.backends.poly import wire
from torchbeast_hydra.backends.poly.batcher import BatcherClosed, DynamicBatcher
from torchbeast_hydra.backends.poly.rollouts import RolloutBuilder, RolloutQueue, row_layout
from torchbeast_hydra.backends.poly.settings import PolyConfig
from torchbeast_hydra.env.actions import ActionSpec
from torchbeast_hydra.env.layout import rollout_specs
from torchbeast_hydra.env.spaces import EnvSpec, Leaf
from torchbeast_hydra.learning import accel
from torchbeast_hydra.learning.learner import compute_losses
from torchbeast_hydra.learning.settings import VtraceConfig

# -- wire ----------------------------------------------------------------------------------------


def test_descriptor_matches_the_proto_file(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    from google.protobuf import descriptor_pb2

    proto_dir = Path(wire.__file__).resolve().parents[3]
    out = tmp_path / "set.pb"
    assert (
        protoc.main(
            [
                "protoc",
                f"-I{proto_dir}",
                f"--descriptor_set_out={out}",
                "torchbeast_hydra/backends/poly/actorpool.proto",
            ]
        )
        == 0
    )
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    ours = wire.file_descriptor()
    for message in compiled.message_type:  # protoc adds JSON names, which we do not use
        for field in message.field:
            field.ClearField("json_name")
    assert compiled.message_type == ours.message_type
    assert compiled.service == ours.service
    assert compiled.package == ours.package


def test_array_round_trip_keeps_dtype_shape_and_values():
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    message = wire.Array.FromString(wire.encode_array(array).SerializeToString())
    decoded = wire.decode_array(message, "frame", "uint8", (2, 3, 4))
    np.testing.assert_array_equal(decoded, array)
    assert not decoded.flags.writeable  # a view of the received bytes, which nothing may change


@pytest.mark.parametrize(
    "dtype, shape, data, reason",
    [
        ("float32", (2, 3, 4), None, "expected uint8 [2, 3, 4], got float32"),
        ("uint8", (2, 3), None, "expected uint8 [2, 3, 4], got uint8 [2, 3]"),
        ("uint8", (2, 3, 4), b"\x00" * 7, "7 bytes do not make"),
    ],
)
def test_array_with_wrong_dtype_shape_or_size_is_rejected(dtype, shape, data, reason):
    message = wire.encode_array(np.zeros(shape, dtype))
    if data is not None:
        message.data = data
    with pytest.raises(wire.WireError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        wire.decode_array(message, "frame", "uint8", (2, 3, 4))


def test_an_array_in_foreign_byte_order_travels_as_its_values():
    array = np.arange(6, dtype=">i4").reshape(2, 3)  # an env may hand out big-endian arrays
    message = wire.Array.FromString(wire.encode_array(array).SerializeToString())
    np.testing.assert_array_equal(wire.decode_array(message, "obs/x", "int32", (2, 3)), array)


def test_bool_bytes_other_than_0_and_1_are_rejected():
    message = wire.encode_array(np.zeros(2, bool))
    message.data = bytes([1, 7])
    with pytest.raises(wire.WireError, match="done: bool bytes must be 0 or 1"):
        wire.decode_array(message, "done", "bool", (2,))


def test_a_leaf_of_a_subclassed_space_is_checked_as_its_base_space():
    class Cells(gym.spaces.Discrete):  # a user's env may subclass gymnasium's spaces
        pass

    leaf = Leaf("obs/cell", ("cell",), Cells(3))
    wire.check_leaf(leaf, np.array([0, 2]))
    with pytest.raises(wire.WireError, match=r"obs/cell is outside Discrete\(3\) for envs \[1\]"):
        wire.check_leaf(leaf, np.array([0, 3]))


def test_a_float_leafs_limit_is_the_range_of_the_dtype_the_model_computes_in():
    frame = EnvSpec.box((2,), np.float32, 2).leaves[0]
    bf16 = accel.float_limit(bf16=True)
    assert bf16 == torch.finfo(torch.bfloat16).max < accel.float_limit(bf16=False)
    near_max = np.array([[0, 0], [3.395e38, 0]], np.float32)  # finite in float32, inf in bf16
    wire.check_leaf(frame, near_max)  # float32: taken
    with pytest.raises(wire.WireError, match=r"frame has values beyond \+-3\.39e\+38, .* for envs \[1\]"):
        wire.check_leaf(frame, near_max, bf16)
    wide = EnvSpec.box((2,), np.float64, 2).leaves[0]
    with pytest.raises(wire.WireError, match=r"frame has values beyond \+-3\.403e\+38, .* for envs \[0\]"):
        wire.check_leaf(wide, np.array([[-1e300, 0], [0, 0]]))
    with pytest.raises(wire.WireError, match=r"frame has non-finite values \(NaN/inf\) for envs \[1\]"):
        wire.check_leaf(wide, np.array([[1e300, 0], [np.inf, 0]]))


def env_outputs(n=2, last_action=0, reward=0.0):
    return dict(
        frame=np.zeros((n, 4), np.float32),
        reward=np.full(n, reward, np.float32),
        done=np.zeros(n, bool),
        episode_return=np.zeros(n, np.float32),
        episode_step=np.zeros(n, np.int32),
        last_action=np.full(n, last_action, np.int64),
        episode_end=np.zeros(n, bool),
    )


STEP_SPEC = EnvSpec.box((4,), np.dtype("float32"), 3)


def decode(raw, n=2):
    return wire.decode_step(wire.parse(wire.ClientMessage, raw), n, STEP_SPEC)


def test_step_round_trip():
    outputs = env_outputs()
    outputs["frame"][1] = [1, 2, 3, 4]
    decoded = decode(wire.encode_step(outputs))
    for key, value in outputs.items():
        np.testing.assert_array_equal(decoded[key], value)


BAD_REWARD = "reward must be finite and within \\+-1e\\+09"


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xff\xff\xff\xff", "not a ClientMessage"),
        (wire.ClientMessage(hello=wire.Hello(env_id="x")).SerializeToString(), "expected a step, got hello"),
        (b"", "expected a step, got an empty message"),
        (wire.encode_step(env_outputs(last_action=3)), "outside the action space"),
        (wire.encode_step(env_outputs(reward=math.nan)), f"{BAD_REWARD} for envs \\[0, 1\\]"),
        (wire.encode_step(env_outputs(reward=1e25)), f"{BAD_REWARD} for envs \\[0, 1\\]"),
        (
            wire.encode_step(dict(env_outputs(), frame=np.array([[0, 0, 0, 0], [0, math.inf, 0, 0]], np.float32))),
            "frame has non-finite values \\(NaN/inf\\) for envs \\[1\\]",
        ),
        (wire.encode_step(env_outputs(n=3)), "expected float32 \\[2, 4\\], got float32 \\[3, 4\\]"),
    ],
)
def test_malformed_steps_are_rejected_with_the_reason(raw, reason):
    with pytest.raises(wire.WireError, match=reason):
        decode(raw)


def test_actions_outside_the_action_space_are_rejected():
    with pytest.raises(wire.WireError, match="outside the action space"):
        wire.decode_actions(wire.encode_array(np.array([0, 5])), 2, ActionSpec.discrete(3))


# -- dynamic batcher -----------------------------------------------------------------------------


class Recorder:
    """fn for a batcher: doubles its input and records the batch sizes it saw."""

    def __init__(self, delay=0.0):
        self.sizes, self.delay = [], delay

    def __call__(self, inputs):
        self.sizes.append(len(inputs["x"]))
        time.sleep(self.delay)
        return {"y": inputs["x"] * 2}


def test_many_producers_get_their_own_answers_in_batches_of_at_most_max_size():
    fn = Recorder(delay=0.002)
    batcher = DynamicBatcher(fn, max_batch_size=8, timeout_s=0.01)
    errors = []

    def producer(k):
        for i in range(20):
            x = torch.full((3,), float(k * 1000 + i))
            y = batcher({"x": x})["y"]
            if not torch.equal(y, x * 2):
                errors.append((k, i))

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [size for size, _, _ in batcher.take_stats()] == fn.sizes
    batcher.close()
    assert not errors
    assert sum(fn.sizes) == 10 * 20 * 3
    assert max(fn.sizes) <= 8  # 3 + 3 fit; a third request would not
    assert max(fn.sizes) == 6  # and ten busy producers do fill batches


def test_a_lone_request_runs_after_the_timeout_without_waiting_for_a_full_batch():
    fn = Recorder()
    batcher = DynamicBatcher(fn, max_batch_size=64, timeout_s=0.05)
    started = time.monotonic()
    batcher({"x": torch.ones(2)})
    assert time.monotonic() - started < 5  # generous: it must not wait for 64
    batcher.close()
    assert fn.sizes == [2]


def test_no_waiting_once_every_producer_is_in_the_batch():
    fn = Recorder()
    batcher = DynamicBatcher(fn, max_batch_size=64, timeout_s=60.0, producers=lambda: 1)
    started = time.monotonic()
    batcher({"x": torch.ones(2)})
    assert time.monotonic() - started < 30  # not the 60 s timeout
    batcher.close()


def test_a_request_larger_than_max_runs_alone_and_unsplit():
    fn = Recorder()
    batcher = DynamicBatcher(fn, max_batch_size=4, timeout_s=0.01)
    assert batcher({"x": torch.ones(10)})["y"].shape == (10,)
    batcher.close()
    assert fn.sizes == [10]


def test_a_batchs_cpu_counts_the_host_work_and_not_the_waits():
    def spin(inputs):  # 30 ms of CPU, as a model's host work
        deadline = time.thread_time() + 0.03
        while time.thread_time() < deadline:
            pass
        return inputs

    def sleep(inputs):  # 30 ms of waiting, as a model on a device
        time.sleep(0.03)
        return inputs

    for fn, busy in ((spin, True), (sleep, False)):
        batcher = DynamicBatcher(fn, max_batch_size=4, timeout_s=0.001)
        batcher({"x": torch.zeros(2)})
        [(size, seconds, cpu)] = batcher.take_stats()
        batcher.close()
        assert size == 2 and seconds >= 0.03
        assert cpu >= 0.03 if busy else cpu < 0.015


def test_an_error_reaches_every_caller_and_the_batcher_keeps_serving():
    def fn(inputs):
        if (inputs["x"] < 0).any():
            raise ValueError("negative input")
        return {"y": inputs["x"]}

    told = []

    def on_error(error):  # slow to take note: a caller must still not hear of the error before it has
        time.sleep(0.2)
        told.append(error)

    batcher = DynamicBatcher(fn, max_batch_size=4, timeout_s=0.01, on_error=on_error)
    with pytest.raises(ValueError, match="negative input"):
        batcher({"x": -torch.ones(1)})
    assert len(told) == 1 and str(told[0]) == "negative input"  # the owner knew first
    assert batcher({"x": torch.ones(1)})["y"].item() == 1
    batcher.close()
    with pytest.raises(BatcherClosed):
        batcher({"x": torch.ones(1)})


def test_inputs_must_share_the_batch_dimension():
    batcher = DynamicBatcher(Recorder(), max_batch_size=4, timeout_s=0.01)
    with pytest.raises(ValueError, match="leading"):
        batcher.submit({"x": torch.ones(2), "z": torch.ones(3)})
    batcher.close()


# -- unroll assembly -----------------------------------------------------------------------------

SPEC = EnvSpec.box((1,), np.dtype("float32"), 2)


class Steps:
    """Drives a RolloutBuilder like a session: env k's frame at its step t is 100*k + t."""

    def __init__(self, num_envs=2, unroll_length=3, cut_at_reset=True, state_size=0, chunk_size=1, buffers=None):
        """buffers: the builder's fixed rows, which step() then writes itself, as a local client does."""
        self.emitted = []
        self.n = num_envs
        initial = (torch.zeros(num_envs, state_size),) if state_size else ()
        self.buffers = buffers
        self.builder = RolloutBuilder(
            rollout_specs(SPEC), num_envs, unroll_length, initial, cut_at_reset, self.receive, chunk_size, buffers
        )
        self.chunks = []
        self.t = 0

    def receive(self, rollouts, state):
        """A chunk [T+1, k, ...]: kept whole, and split into per-env rollouts [T+1, ...] in emitted."""
        self.chunks.append((rollouts, state))
        for i in range(rollouts["mask"].shape[1]):
            self.emitted.append(({key: value[:, i] for key, value in rollouts.items()}, tuple(s[i] for s in state)))

    def step(self, episode_end=(), state=()):
        out = env_outputs(self.n)
        out["frame"] = np.array([[100.0 * k + self.t] for k in range(self.n)], np.float32)
        out["reward"][:] = self.t
        out["episode_end"][list(episode_end)] = True
        out["done"] = out["episode_end"].copy()
        if self.buffers:
            buffer, row = self.builder.next_row()
            for key in self.builder.env_keys:
                self.buffers[buffer][key][row] = out[key]
        self.builder.add(out, state, written=self.builder.env_keys if self.buffers else ())
        # The policy's outputs for this row: action t % 2, baseline = frame.
        self.builder.set_agent_outputs(
            dict(
                action=np.full(self.n, self.t % 2),
                baseline=out["frame"][:, 0],
                policy_logits=np.zeros((self.n, 2), np.float32),
                policy_version=np.full(self.n, self.t),
            )
        )
        self.t += 1


def test_full_unrolls_follow_the_layout_and_overlap_by_one_row():
    steps = Steps(num_envs=2, unroll_length=3)
    for _ in range(7):  # rows 0..3 make the first unroll; rows 3..6 the second
        steps.step()
    assert len(steps.emitted) == 4  # two envs x two unrolls
    (first, _), (_, _), (second, _), _ = steps.emitted
    assert first["frame"][:, 0].tolist() == [0, 1, 2, 3]
    # Row t+1 holds the response to the action chosen at row t, and that choice's outputs.
    assert first["reward"].tolist() == [0, 1, 2, 3]
    assert first["action"].tolist() == [0, 0, 1, 0]  # row 0 has no action before it
    assert first["baseline"].tolist() == [0, 0, 1, 2]
    assert first["mask"].all()
    assert second["frame"][:, 0].tolist() == [3, 4, 5, 6]
    assert second["action"].tolist() == [0, 1, 0, 1]


def test_envs_that_finish_together_leave_in_chunks_of_at_most_chunk_size():
    steps = Steps(num_envs=3, unroll_length=2, state_size=1, chunk_size=2)
    for _ in range(3):
        steps.step(state=(torch.tensor([[0.0], [1.0], [2.0]]),))
    assert [c["mask"].shape for c, _ in steps.chunks] == [(3, 2), (3, 1)]
    (first, (first_state,)), (second, (second_state,)) = steps.chunks
    assert first["frame"][:, :, 0].tolist() == [[0, 100], [1, 101], [2, 102]]
    assert second["frame"][:, 0, 0].tolist() == [200, 201, 202]
    assert first_state.tolist() == [[0.0], [0.0]] and second_state.tolist() == [[0.0]]  # initial states
    # A chunk holds copies: the builder's next unrolls do not change it.
    for _ in range(2):
        steps.step()
    assert first["frame"][:, :, 0].tolist() == [[0, 100], [1, 101], [2, 102]]


def test_a_reset_cuts_a_partial_rollout_and_the_env_goes_on_in_step():
    steps = Steps(num_envs=2, unroll_length=4)
    steps.step()
    steps.step()
    steps.step(episode_end=[1])  # env 1's episode ends at row 2
    assert len(steps.emitted) == 1
    rollout, _ = steps.emitted[0]
    assert rollout["mask"].tolist() == [True, True, True, False, False]
    assert rollout["frame"][:3, 0].tolist() == [100, 101, 102]
    steps.step()
    steps.step()  # row 4: both envs' unrolls end together
    (env0, _), (env1, _) = steps.emitted[1:]
    assert env0["frame"][:, 0].tolist() == [0, 1, 2, 3, 4] and env0["mask"].all()
    # env 1's rows after its reset: rows 1 and 2 went with the partial rollout
    assert env1["frame"][:, 0].tolist() == [100, 101, 102, 103, 104]
    assert env1["mask"].tolist() == [True, False, False, True, True]
    for _ in range(4):
        steps.step()
    (env0, _), (env1, _) = steps.emitted[3:]
    assert env1["frame"][:, 0].tolist() == [104, 105, 106, 107, 108] and env1["mask"].all()


def test_rows_masked_before_a_reset_teach_what_the_same_rows_alone_would():
    """The unroll an env ends after a reset (masked rows first) gives the learner the losses of its
    real rows alone, padded after: masked rows are padding wherever they are."""
    steps = Steps(num_envs=1, unroll_length=4)
    for t in range(5):
        steps.step(episode_end=[0] if t == 2 else [])
    (_, _), (after, _) = steps.chunks
    assert after["mask"][:, 0].tolist() == [True, False, False, True, True]
    alone = {key: torch.cat([value[2:], value[2:3].expand(2, *value.shape[1:])]) for key, value in after.items()}
    alone["mask"] = torch.tensor([[True], [True], [True], [False], [False]])
    torch.manual_seed(0)
    logits, values = torch.randn(5, 1, 2), torch.randn(5, 1)
    cfg = OmegaConf.structured(VtraceConfig(discounting=0.9, entropy_cost=0.01))

    def losses(batch, rows):
        outputs = dict(policy_logits=torch.cat([logits[rows][1:], logits[rows][:1]]), baseline=values[rows])
        return compute_losses(cfg, batch, outputs)

    masked_first = losses(after, [0, 1, 2, 3, 4])
    real_alone = losses(alone, [2, 3, 4, 0, 1])  # the same outputs on the same real rows
    for key in ("pg_loss", "baseline_loss", "entropy_loss"):
        assert masked_first[key].item() == pytest.approx(real_alone[key].item(), rel=1e-5), key


def test_without_cut_at_reset_unrolls_span_episodes():
    steps = Steps(num_envs=1, unroll_length=3, cut_at_reset=False)
    for t in range(4):
        steps.step(episode_end=[0] if t == 1 else [])
    ((rollout, _),) = steps.emitted
    assert rollout["mask"].all() and rollout["done"].tolist() == [False, True, False, False]


def test_flush_hands_on_unfinished_unrolls_and_skips_empty_ones():
    steps = Steps(num_envs=2, unroll_length=5)
    steps.step()
    assert steps.builder.flush() == 0  # only row 0: nothing to learn from
    steps.step()
    steps.step()
    steps.step()
    assert steps.builder.flush() == 2
    assert [r["mask"].sum().item() for r, _ in steps.emitted] == [3, 3]


def test_core_state_recorded_is_the_state_before_row_zero():
    steps = Steps(num_envs=1, unroll_length=2, state_size=3)
    for t in range(5):
        steps.step(state=(torch.full((1, 3), float(t)),))
    states = [state[0].tolist() for _, state in steps.emitted]
    assert states == [[0.0] * 3, [2.0] * 3]  # the initial state; then the one before row 2's frame


class Lending(Steps):
    """Steps whose emitter takes buffers, as the learner's queue does: lent chunks keep their release."""

    def __init__(self, **kwargs):
        self.releases = []
        super().__init__(**kwargs)

    def receive(self, rollouts, state, release=None):
        super().receive(rollouts, state)
        self.releases.append(release)

    receive.takes_buffers = True


def test_envs_that_end_together_lend_their_rows_whole_and_refill_rows_given_back():
    steps = Lending(num_envs=4, unroll_length=2, chunk_size=2)
    rows = steps.builder.rows["frame"]
    for _ in range(3):  # rows 0..2: every env's first unroll ends at once
        steps.step()
    (first, _), (second, _) = steps.chunks
    # Each group's columns of the rows as they are, no copy: the chunk is the builder's memory.
    assert first["frame"].data_ptr() == rows[0, 0].ctypes.data and second["frame"].data_ptr() == rows[0, 2].ctypes.data
    assert first["mask"].all()
    assert first["frame"][:, :, 0].tolist() == [[0, 100], [1, 101], [2, 102]]
    assert second["frame"][:, :, 0].tolist() == [[200, 300], [201, 301], [202, 302]]
    steps.step()  # the next unrolls go into fresh rows: the lent ones are not written
    assert first["frame"][:, :, 0].tolist() == [[0, 100], [1, 101], [2, 102]]
    # Given back only once both chunks are released; the builder fills them again at its next lend.
    steps.releases[0]()
    steps.step()  # rows 2..4 end together: lent; one chunk of the first rows is still out: fresh rows
    third = steps.chunks[2][0]
    assert third["frame"][:, :, 0].tolist() == [[2, 102], [3, 103], [4, 104]]  # row 0 from the lent rows
    assert third["frame"].data_ptr() not in (rows[0, 0].ctypes.data, rows[0, 2].ctypes.data)
    assert steps.builder.rows["frame"] is not rows
    steps.releases[1]()
    for _ in range(2):  # rows 4..6 end together: lent, and the first rows, now given back, are filled next
        steps.step()
    assert steps.builder.rows["frame"] is rows
    for _ in range(2):
        steps.step()
    seventh, eighth = steps.chunks[6][0], steps.chunks[7][0]
    assert seventh["frame"].data_ptr() == rows[0, 0].ctypes.data
    assert seventh["frame"][:, :, 0].tolist() == [[6, 106], [7, 107], [8, 108]]
    assert eighth["frame"][:, :, 0].tolist() == [[206, 306], [207, 307], [208, 308]]


def test_a_reset_hands_on_a_copy_and_the_unroll_ending_later_is_still_lent():
    steps = Lending(num_envs=4, unroll_length=3, chunk_size=2)
    steps.step()
    steps.step(episode_end=[1])  # env 1 alone: a partial rollout, copied out of its group's rows
    ((cut, _),) = steps.chunks
    assert steps.releases == [None] and cut["frame"][:2, 0, 0].tolist() == [100, 101]
    assert cut["mask"][:, 0].tolist() == [True, True, False, False]
    rows = steps.builder.rows["frame"]
    steps.step()
    steps.step()  # row 3: every env's unroll ends, env 1's after its reset: lent all the same
    assert len(steps.chunks) == 3 and None not in steps.releases[1:]
    first = steps.chunks[1][0]
    assert first["frame"].data_ptr() == rows[0, 0].ctypes.data
    assert first["frame"][:, :, 0].T.tolist() == [[0, 1, 2, 3], [100, 101, 102, 103]]
    assert first["mask"].T.tolist() == [[True] * 4, [True, False, True, True]]
    assert cut["frame"][:2, 0, 0].tolist() == [100, 101]  # the partial is a copy: unchanged


def test_fixed_rows_written_in_place_are_lent_while_others_are_free_and_copied_out_when_none_is():
    layout = row_layout(rollout_specs(SPEC), 2, 2)
    buffers = [{key: np.zeros(shape, dtype) for key, (shape, dtype) in layout.items()} for _ in range(2)]
    steps = Lending(num_envs=2, unroll_length=2, chunk_size=2, buffers=buffers)
    assert steps.builder.next_row() == (0, 0)
    for _ in range(3):  # rows 0..2 of buffer 0, written by the "client": lent as they are
        steps.step()
    lent = steps.chunks[0][0]
    assert lent["frame"].data_ptr() == buffers[0]["frame"].ctypes.data and steps.releases[0] is not None
    assert steps.builder.next_row() == (1, 1)  # row 0 of buffer 1 repeats row 2
    assert buffers[1]["frame"][0, :, 0].tolist() == [2, 102]
    for _ in range(2):  # buffer 0 is still out: the unroll ending in buffer 1 is copied, buffer 1 kept
        steps.step()
    copied = steps.chunks[1][0]
    assert steps.releases[1] is None and copied["frame"][:, :, 0].tolist() == [[2, 102], [3, 103], [4, 104]]
    assert steps.builder.next_row() == (1, 1)
    steps.releases[0]()  # buffer 0 given back: the next unroll is lent, and buffer 0 filled after it
    for _ in range(2):
        steps.step()
    assert steps.chunks[2][0]["frame"].data_ptr() == buffers[1]["frame"].ctypes.data
    assert steps.chunks[2][0]["frame"][:, :, 0].tolist() == [[4, 104], [5, 105], [6, 106]]
    assert copied["frame"][:, :, 0].tolist() == [[2, 102], [3, 103], [4, 104]]  # a copy: untouched
    assert steps.builder.next_row() == (0, 1)


def test_partial_rollout_vtrace_target_matches_a_hand_computation():
    # T=4 with a disconnect after 2 real steps; on-policy (rho = 1), gamma = 0.5.
    steps = Steps(num_envs=1, unroll_length=4)
    for _ in range(3):
        steps.step()
    steps.builder.flush()
    ((rollout, _),) = steps.emitted
    ((batch, _),) = steps.chunks  # one chunk of one env: already a batch [T+1, 1, ...]
    logits = batch["policy_logits"]
    values = torch.tensor([[1.0], [2.0], [4.0], [8.0], [16.0]])  # V(x_0..x_4); x_3, x_4 are padding
    outputs = dict(policy_logits=torch.cat([logits[1:], logits[:1]]), baseline=values)
    cfg = OmegaConf.structured(VtraceConfig(discounting=0.5, baseline_cost=1.0, entropy_cost=0.0))
    losses = compute_losses(cfg, batch, outputs)
    # Rewards of rows 1, 2 are 1 and 2 (clipped to 1, 1). vs_1 = r_1 + g V(x_2) = 1 + 2 = 3;
    # vs_0 = r_0 + g vs_1 = 1 + 1.5 = 2.5. The padding adds nothing.
    expected = 0.5 * ((2.5 - 1.0) ** 2 + (3.0 - 2.0) ** 2)
    assert losses["baseline_loss"].item() == pytest.approx(expected)
    assert rollout["mask"].tolist() == [True, True, True, False, False]


# -- the learner's rollout queue ------------------------------------------------------------------


def chunk(first_env, k, T=2, state_size=3):
    """k rollouts whose frames hold their env number; states [k, layers=1, state_size]."""
    envs = torch.arange(first_env, first_env + k, dtype=torch.float32)
    rollouts = dict(frame=envs.expand(T + 1, k).clone(), mask=torch.ones(T + 1, k, dtype=torch.bool))
    return rollouts, (envs.view(k, 1, 1).expand(k, 1, state_size).clone(),)


def test_the_queue_cuts_batches_across_chunks_in_order_with_their_states():
    rollouts = RolloutQueue(capacity=100)
    stopping = threading.Event()
    for first, k in ((0, 3), (3, 2), (5, 4)):
        rollouts.put(*chunk(first, k), stopping)
    assert rollouts.qsize() == 9
    sizes = []
    for _ in range(3):
        batch, (state,) = rollouts.get_batch(3, lambda: False)
        sizes.append(batch["frame"][0].tolist())
        assert state.shape == (1, 3, 3) and state[0, :, 0].tolist() == batch["frame"][0].tolist()
    assert sizes == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert rollouts.qsize() == 0 and rollouts.get_batch(1, lambda: True) is None


def test_a_batch_inside_one_chunk_is_a_view_without_a_copy():
    rollouts = RolloutQueue(capacity=100)
    data, state = chunk(0, 8)
    rollouts.put(data, state, threading.Event())
    batch, _ = rollouts.get_batch(4, lambda: False)
    assert batch["frame"].data_ptr() == data["frame"].data_ptr()


def test_put_waits_while_the_queue_is_full_and_not_once_stopping():
    rollouts = RolloutQueue(capacity=2)
    stopping = threading.Event()
    rollouts.put(*chunk(0, 2), stopping)
    second = threading.Thread(target=rollouts.put, args=(*chunk(2, 2), stopping))
    second.start()
    second.join(timeout=0.3)
    assert second.is_alive() and rollouts.qsize() == 2  # back-pressure
    rollouts.get_batch(1, lambda: False)
    second.join(timeout=5)
    assert not second.is_alive() and rollouts.qsize() == 3
    stopping.set()
    rollouts.put(*chunk(4, 2), stopping)  # returns at once, dropping the chunk: the run is over
    assert rollouts.qsize() == 3


def test_a_client_whose_learner_is_gone_for_good_gives_up_after_connect_timeout_s():
    from torchbeast_hydra.backends.poly.client import UNREACHABLE, Connection, EnvClient
    from torchbeast_hydra.env.settings import EnvConfig

    client = EnvClient(EnvConfig(id="CartPole-v1"), Connection("127.0.0.1:1", "token", 0.5, 1 << 20), num_envs=1)
    sessions = []

    def session():  # served once, then the learner is gone: every later attempt finds no one
        sessions.append(time.monotonic())
        client.welcomed = len(sessions) == 1  # as _session and _serve set it
        client.outputs = client.outputs or {"obs": "the envs' last outputs, kept across sessions"}
        raise ConnectionError("the learner closed the stream" if len(sessions) == 1 else "cannot connect")

    client._session = session
    done = []
    thread = threading.Thread(target=lambda: done.append(client.run()), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert done == [UNREACHABLE], f"still retrying after {len(sessions)} attempts"
    assert sessions[-1] - sessions[0] < 3  # the wait restarted once, when the served session was lost


def test_a_shards_slot_is_given_back_once_copied_or_once_a_lent_batch_is_done():
    rollouts = RolloutQueue(capacity=100)
    released = []
    stopping = threading.Event()
    rollouts.put(*chunk(0, 3), stopping, release=lambda: released.append("a"))
    rollouts.put(*chunk(3, 2), stopping, release=lambda: released.append("b"))
    batch, (state,) = rollouts.get_batch(2, lambda: False)  # part of slot a: copied, a still queued
    assert released == [] and batch["frame"][0].tolist() == [0, 1]
    batch, (state,) = rollouts.get_batch(2, lambda: False)  # the rest of a and part of b: a is back
    assert released == ["a"] and batch["frame"][0].tolist() == [2, 3]
    rollouts.put(*chunk(5, 2), stopping, release=lambda: released.append("c"))
    batch, (state,) = rollouts.get_batch(1, lambda: False)  # the rest of b
    assert released == ["a", "b"] and batch["frame"][0].tolist() == [4]
    batch, (state,) = rollouts.get_batch(2, lambda: False)  # slot c whole: lent, not copied
    assert released == ["a", "b"] and batch["frame"][0].tolist() == [5, 6]
    rollouts.put(*chunk(7, 1), stopping, release=lambda: released.append("d"))
    rollouts.get_batch(1, lambda: False)  # the learner is done with c
    assert released[:3] == ["a", "b", "c"]


def test_a_sessions_lent_rows_are_read_in_place_and_given_back_once_the_learner_is_done():
    rollouts = RolloutQueue(capacity=100)
    released = []
    stopping = threading.Event()
    a, b = chunk(0, 3), chunk(3, 2)
    rollouts.put(*a, stopping, release=lambda: released.append("a"), scarce=False)
    rollouts.put(*b, stopping, release=lambda: released.append("b"), scarce=False)
    batch, _ = rollouts.get_batch(2, lambda: False)  # part of a: its rows in place, not copied
    assert batch["frame"].data_ptr() == a[0]["frame"].data_ptr() and released == []
    batch, _ = rollouts.get_batch(2, lambda: False)  # the rest of a and part of b, joined: a is back
    assert released == ["a"] and batch["frame"][0].tolist() == [2, 3]
    batch, _ = rollouts.get_batch(1, lambda: False)  # the rest of b, in place: back at the next batch
    assert released == ["a"] and batch["frame"].data_ptr() == b[0]["frame"][:, 1:].data_ptr()
    rollouts.put(*chunk(5, 1), stopping)
    rollouts.get_batch(1, lambda: False)
    assert released == ["a", "b"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({}, 1),  # role=all's own clients on shared memory: one process, whatever the cores
        ({"local_transport": "grpc"}, 4),  # its own clients over gRPC: a shard per 4 cores
        ({"local_transport": "grpc", "num_actors": 2}, 2),  # ... no more than its clients
        ({"role": "learner"}, 4),  # remote clients only: a shard per 4 cores
        ({"role": "learner", "server_shards": 3}, 3),  # asked for
        ({"role": "learner", "synchronous": True}, 1),  # sessions wait on the learner's weights
    ],
)
def test_server_shards_follow_what_the_server_serves(monkeypatch, overrides, expected):
    monkeypatch.setattr(poly_backend, "usable_cores", lambda: 16)
    backend = OmegaConf.merge(OmegaConf.structured(PolyConfig(num_actors=15)), overrides)
    assert poly_backend.server_shards(backend) == expected
