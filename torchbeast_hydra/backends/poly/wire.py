"""The wire format: protobuf messages (see actorpool.proto) carrying arrays as raw bytes.

The message classes are built from a descriptor at import time, so users need no code
generation step and any protobuf runtime >= 4.21 works. Arrays travel as bytes + dtype + shape
and are decoded with numpy, never unpickled; every decode checks what it received against what
it expects and raises WireError with the reason.
"""

from __future__ import annotations

import functools
import itertools
import json
import math

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from torchbeast_hydra.backends.poly.frame_stacks import StackError, StackReceiver, StackSender
from torchbeast_hydra.env.actions import ActionError, ActionSpec, bad_rows, check
from torchbeast_hydra.env.layout import ENV_KEYS, FLOAT32_LIMIT, fits_limit, within_limit

FRAME = "frame"  # envs.FRAME (not imported: this module must not pull in gymnasium's env registry)

PACKAGE = "torchbeast_hydra.poly"
SERVICE = f"{PACKAGE}.ActorPool"
CONNECT = f"/{SERVICE}/Connect"
TOKEN_METADATA_KEY = "x-torchbeast-token"

# The env outputs a client sends each step, in Step's field order: the rollout layout's env keys.
# `frame` carries an observation that is one array; a Dict/Tuple observation's leaves travel in
# Step.obs instead, one named Array each.
STEP_KEYS = ENV_KEYS
OTHER_STEP_KEYS = tuple(key for key in STEP_KEYS if key != FRAME)  # reward, done, ..., last_action


class WireError(ValueError):
    """A message that does not fit the protocol; the text says what was wrong."""


_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = dict(bytes=_F.TYPE_BYTES, string=_F.TYPE_STRING, int32=_F.TYPE_INT32, int64=_F.TYPE_INT64)


def _message(name: str, fields: list, oneof: str | None = None, skip=()) -> descriptor_pb2.DescriptorProto:
    """fields: (name, type) pairs numbered from 1, past the reserved numbers in skip (fields that
    are gone); "repeated T" for lists, message names otherwise."""
    message = descriptor_pb2.DescriptorProto(name=name)
    if oneof:
        message.oneof_decl.add(name=oneof)
    for number in skip:
        message.reserved_range.add(start=number, end=number + 1)
    numbers = (n for n in itertools.count(1) if n not in skip)
    for number, (field_name, kind) in zip(numbers, fields):
        repeated = kind.startswith("repeated ")
        kind = kind.removeprefix("repeated ")
        field = message.field.add(
            name=field_name, number=number, label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
        )
        if kind in _SCALARS:
            field.type = _SCALARS[kind]
        else:
            field.type, field.type_name = _F.TYPE_MESSAGE, f".{PACKAGE}.{kind}"
        if oneof:
            field.oneof_index = 0
    return message


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """actorpool.proto, as a descriptor."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="torchbeast_hydra/poly/actorpool.proto", package=PACKAGE, syntax="proto3"
    )
    proto.message_type.extend(
        [
            _message(
                "Array", [("data", "bytes"), ("dtype", "string"), ("shape", "repeated int64"), ("name", "string")]
            ),
            _message(
                "Hello",
                [("env_id", "string"), ("num_envs", "int32"), ("action_space", "string"), ("obs", "repeated Array")],
                skip=(3, 4),  # obs_shape and obs_dtype, before observations had leaves
            ),
            # newest_only and newest: frame_stacks.py (a stack of frames sent one frame at a time).
            _message(
                "Step",
                [
                    *((key, "Array") for key in STEP_KEYS),
                    ("obs", "repeated Array"),
                    ("newest_only", "Array"),
                    ("newest", "Array"),
                ],
            ),
            _message("ClientMessage", [("hello", "Hello"), ("step", "Step")], oneof="kind"),
            _message("Welcome", [("client_id", "int64"), ("seed", "int64")]),
            _message("Finished", [("reason", "string")]),
            _message(
                "ServerMessage", [("welcome", "Welcome"), ("actions", "Array"), ("finished", "Finished")], oneof="kind"
            ),
        ]
    )
    service = proto.service.add(name="ActorPool")
    service.method.add(
        name="Connect",
        input_type=f".{PACKAGE}.ClientMessage",
        output_type=f".{PACKAGE}.ServerMessage",
        client_streaming=True,
        server_streaming=True,
    )
    return proto


_pool = descriptor_pool.DescriptorPool()
_pool.Add(file_descriptor())


def _class(name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))


Array = _class("Array")
Hello = _class("Hello")
Step = _class("Step")
ClientMessage = _class("ClientMessage")
Welcome = _class("Welcome")
Finished = _class("Finished")
ServerMessage = _class("ServerMessage")


def max_message_bytes(spec, max_envs: int) -> int:
    """The largest Step a client may send: max_envs envs' observations (every leaf), last actions
    and scalars, with headroom. spec: envs.EnvSpec."""
    per_env = spec.obs_bytes + 8 * spec.actions.size + 64
    return max_envs * per_env + 64 * 1024 + 256 * len(spec.leaves)


def channel_options(max_message_bytes: int) -> list:
    """gRPC options both ends of a stream use (server and client)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Notice a vanished peer (a machine that went away without closing the connection).
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


@functools.cache
def dtype_name(dtype: np.dtype) -> str:
    """dtype.name, remembered: numpy works it out anew on each read (~2 us), and every step a
    server decodes reads one per array."""
    return dtype.name


@functools.cache
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize  # making the dtype from its name costs more than the rest of a check


def encode_array(array: np.ndarray, message=None):
    message = Array() if message is None else message
    # In native byte order: the dtype's name does not carry it (an env may return big-endian arrays).
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    message.data = array.tobytes()
    message.dtype = dtype_name(array.dtype)
    message.shape[:] = array.shape
    return message


def decode_array(message, name: str, dtype: str, shape: tuple) -> np.ndarray:
    """The array in message, which must have exactly this dtype and shape: a read-only array over
    the bytes the message hands out, with no further copy (the unrolls copy every frame anyway).
    """
    # (A repeated field's slice is a list: the cheapest of its comparisons, and each step makes ~9.)
    if message.dtype != dtype or message.shape[:] != list(shape):
        raise WireError(f"{name}: expected {dtype} {list(shape)}, got {message.dtype or '?'} {list(message.shape)}")
    data = message.data
    if len(data) != math.prod(shape) * _itemsize(dtype):
        raise WireError(f"{name}: {len(data)} bytes do not make a {dtype} array of shape {list(shape)}")
    # numpy and torch take any nonzero byte as a bool but leave it as it is, which later ops need not
    # handle. (What is left once every 0 and 1 byte is deleted: one pass in C, no array made.)
    if dtype == "bool" and data.translate(None, b"\x00\x01"):
        raise WireError(f"{name}: bool bytes must be 0 or 1")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def parse(message_class, raw: bytes):
    message = message_class()
    try:
        message.ParseFromString(raw)
    except (DecodeError, RuntimeError, ValueError) as error:
        raise WireError(f"not a {message_class.__name__} ({error})") from None
    return message


def action_space_text(spec: ActionSpec) -> str:
    """The action space as a Hello carries it (JSON): the server compares it with its own."""
    return json.dumps(spec.signature(), sort_keys=True)


def encode_hello(spec, env_id: str, num_envs: int) -> bytes:
    """A stream's first message: the env (spec: envs.EnvSpec) the server checks the client against,
    each observation leaf's name, dtype and shape (no data) and the action space."""
    message = ClientMessage()
    hello = message.hello
    hello.env_id, hello.num_envs = env_id, num_envs
    hello.action_space = action_space_text(spec.actions)
    for leaf in spec.leaves:
        hello.obs.add(name=leaf.key, dtype=leaf.dtype.name, shape=leaf.shape)
    return message.SerializeToString()


def encode_step(outputs: dict, leaf_keys: tuple = (FRAME,), stacks: StackSender | None = None) -> bytes:
    """outputs: the env keys' arrays [num_envs, ...]; leaf_keys: the observation's (EnvSpec.leaf_keys);
    stacks: this stream's sender, for a frame that is a stack of frames (frame_stacks.py)."""
    # A fresh message each step: reassigning a reused message's bytes fields grows its arena (slower).
    message = ClientMessage()
    step = message.step
    for key in OTHER_STEP_KEYS:
        encode_array(outputs[key], getattr(step, key))
    if stacks is not None:
        newest_only, whole, newest = stacks.split(outputs[FRAME])
        encode_array(newest_only, step.newest_only)
        encode_array(whole, step.frame)
        encode_array(newest, step.newest)
    elif leaf_keys == (FRAME,):
        encode_array(outputs[FRAME], step.frame)
    else:
        for key in leaf_keys:
            encode_array(outputs[key], step.obs.add()).name = key
    return message.SerializeToString()


def decode_step(
    message,
    num_envs: int,
    spec,
    float_limit: float = FLOAT32_LIMIT,
    stacks: StackReceiver | None = None,
    frames_out: np.ndarray | None = None,
) -> dict:
    """A ClientMessage's Step as arrays [num_envs, ...], views of its bytes; checks every array
    against spec (envs.EnvSpec): names, dtypes, shapes and value ranges. float_limit: the largest
    magnitude a float observation may hold (accel.float_limit, what the model computes with);
    stacks: this stream's receiver where the frame is a stack of frames (frame_stacks.stackable),
    which may then come as newest frames; frames_out: where stacks builds the step's frames."""
    if message.WhichOneof("kind") != "step":
        raise WireError(f"expected a step, got {message.WhichOneof('kind') or 'an empty message'}")
    step = message.step
    arrays = _decode_obs(step, num_envs, spec, stacks, frames_out)
    for key in OTHER_STEP_KEYS:
        shape, dtype = spec.step_specs[key]
        arrays[key] = decode_array(getattr(step, key), key, dtype_name(dtype), (num_envs, *shape))
    return check_step(arrays, spec, float_limit)


# The largest reward a step may carry. The learner squares value errors (returns of many steps,
# summed over a batch) in float32: a reward of 1e25 is finite but makes every loss holding it inf,
# so each batch with that client's unrolls would be skipped. 1e9 leaves those sums ~1e25 at worst.
REWARD_LIMIT = 1e9


def check_step(arrays: dict, spec, float_limit: float = FLOAT32_LIMIT) -> dict:
    """A step's arrays [num_envs, ...] of the right dtypes and shapes, if their values are what
    spec allows: every observation leaf (check_leaf), the last actions, finite rewards; WireError
    if not. What any client sends passes here, over gRPC or shared memory (local.py)."""
    for leaf in spec.leaves:
        check_leaf(leaf, arrays[leaf.key], float_limit)
    try:
        check(spec.actions, arrays["last_action"], "last_action", taken=True)
    except ActionError as error:
        raise WireError(str(error)) from None
    if not np.isfinite(arrays["episode_return"]).all():
        raise WireError("episode_return must be finite")
    sane = np.abs(arrays["reward"]) <= REWARD_LIMIT  # False for NaN and inf too
    if not sane.all():
        raise WireError(
            f"reward must be finite and within +-{REWARD_LIMIT:.0e} for envs {bad_rows(sane)}: past it the "
            "learner's squared value errors overflow (no env pays that much in one step)"
        )
    return arrays


def _decode_obs(step, num_envs: int, spec, stacks: StackReceiver | None, frames_out: np.ndarray | None) -> dict:
    """The observation's leaves: Step.frame for one array (no loop), else Step.obs, one named Array each."""
    newest_frames = step.HasField("newest_only") or step.HasField("newest")
    if newest_frames and stacks is None:
        raise WireError("newest frames sent for an observation that is not a stack of frames")
    if spec.single:
        if step.obs:
            raise WireError(f"extra observation leaves {[a.name for a in step.obs]}: this env's observation is a frame")
        leaf = spec.leaves[0]
        if newest_frames:
            return {FRAME: _decode_stacks(step, num_envs, leaf, stacks, frames_out)}
        frames = decode_array(step.frame, FRAME, dtype_name(leaf.dtype), (num_envs, *leaf.shape))
        return {FRAME: frames if stacks is None else stacks.keep(frames, frames_out)}
    if step.HasField(FRAME):
        raise WireError("extra observation leaf frame: this env's observation has leaves, sent in Step.obs")
    sent = {array.name: array for array in step.obs}
    missing, extra = [k for k in spec.leaf_keys if k not in sent], [k for k in sent if k not in spec.leaf_keys]
    if missing or extra or len(sent) != len(step.obs):
        names = [array.name for array in step.obs]
        twice = sorted({name for name in names if names.count(name) > 1})
        raise WireError(
            f"observation leaves: missing {missing}, extra {extra}, sent twice {twice} "
            f"(this env's: {list(spec.leaf_keys)})"
        )
    return {
        leaf.key: decode_array(sent[leaf.key], leaf.key, dtype_name(leaf.dtype), (num_envs, *leaf.shape))
        for leaf in spec.leaves
    }


def _decode_stacks(step, num_envs: int, leaf, stacks: StackReceiver, out: np.ndarray | None) -> np.ndarray:
    """The stacks of a step that sent some envs' newest frames only (frame_stacks.py)."""
    newest_only = decode_array(step.newest_only, "newest_only", "bool", (num_envs,))
    count, dtype = int(newest_only.sum()), dtype_name(leaf.dtype)
    whole = decode_array(step.frame, FRAME, dtype, (num_envs - count, *leaf.shape))
    newest = decode_array(step.newest, "newest", dtype, (count, *leaf.shape[1:]))
    try:
        return stacks.join(newest_only, whole, newest, out)
    except StackError as error:
        raise WireError(str(error)) from None


def check_leaf(leaf, array: np.ndarray, float_limit: float = FLOAT32_LIMIT) -> np.ndarray:
    """array [num_envs, ...] if its values fit the leaf's space (envs.Leaf) and, for floats, the model's
    range (float_limit); WireError naming the leaf, the envs and the limit if not."""
    if leaf.kind == "Box" and array.dtype.kind in "fc":
        # Not within the space's bounds (envs' float observations often stray past their declared ones),
        # but finite in what the model computes with: a float64 1e300 would be inf there, then NaN.
        if not fits_limit(array, float_limit):
            finite = np.isfinite(array)
            if not finite.all():
                raise WireError(f"{leaf.key} has non-finite values (NaN/inf) for envs {bad_rows(finite)}")
            raise WireError(
                f"{leaf.key} has values beyond +-{float_limit:.4g}, the largest the model computes with, "
                f"for envs {bad_rows(within_limit(array, float_limit))}"
            )
    elif leaf.kind == "MultiBinary":
        binary = (array == 0) | (array == 1)
        if not binary.all():
            raise WireError(f"{leaf.key} has values other than 0 and 1 for envs {bad_rows(binary)}")
    elif leaf.integer_bounds is not None:  # ids that index an embedding: in range, or refused
        low, high = leaf.integer_bounds
        inside = (array >= low) & (array <= high)
        if not inside.all():
            raise WireError(f"{leaf.key} is outside {leaf.space} for envs {bad_rows(inside)}")
    return array


def decode_actions(message, num_envs: int, spec: ActionSpec) -> np.ndarray:
    """The actions a client is sent, [num_envs, *step_shape], checked against its env's space."""
    actions = decode_array(message, "actions", spec.dtype, (num_envs, *spec.step_shape)).copy()
    try:
        check(spec, actions)
    except ActionError as error:
        raise WireError(str(error)) from None
    return actions
