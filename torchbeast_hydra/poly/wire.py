"""The wire format: protobuf messages (see actorpool.proto) carrying arrays as raw bytes.

The message classes are built from a descriptor at import time, so users need no code
generation step and any protobuf runtime >= 4.21 works. Arrays travel as bytes + dtype + shape
and are decoded with numpy, never unpickled; every decode checks what it received against what
it expects and raises WireError with the reason.
"""

from __future__ import annotations

import json
import math

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from ..actions import ActionError, ActionSpec, check
from ..layout import ENV_KEYS

PACKAGE = "torchbeast_hydra.poly"
SERVICE = f"{PACKAGE}.ActorPool"
CONNECT = f"/{SERVICE}/Connect"
TOKEN_METADATA_KEY = "x-torchbeast-token"

# The env outputs a client sends each step, in Step's field order: the rollout layout's env keys.
STEP_KEYS = ENV_KEYS


class WireError(ValueError):
    """A message that does not fit the protocol; the text says what was wrong."""


_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = dict(bytes=_F.TYPE_BYTES, string=_F.TYPE_STRING, int32=_F.TYPE_INT32, int64=_F.TYPE_INT64)


def _message(name: str, fields: list, oneof: str | None = None) -> descriptor_pb2.DescriptorProto:
    """fields: (name, type) pairs numbered from 1; "repeated T" for lists, message names otherwise."""
    message = descriptor_pb2.DescriptorProto(name=name)
    if oneof:
        message.oneof_decl.add(name=oneof)
    for number, (field_name, kind) in enumerate(fields, start=1):
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
            _message("Array", [("data", "bytes"), ("dtype", "string"), ("shape", "repeated int64")]),
            _message(
                "Hello",
                [
                    ("env_id", "string"),
                    ("num_envs", "int32"),
                    ("obs_shape", "repeated int64"),
                    ("obs_dtype", "string"),
                    ("action_space", "string"),
                ],
            ),
            _message("Step", [(key, "Array") for key in STEP_KEYS]),
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


def max_message_bytes(obs_shape: tuple, obs_dtype, max_envs: int, action_size: int = 1) -> int:
    """The largest Step a client may send: max_envs envs' frames, last actions (action_size
    numbers each) and scalars, with headroom."""
    per_env = math.prod(obs_shape) * np.dtype(obs_dtype).itemsize + 8 * action_size + 64
    return max_envs * per_env + 64 * 1024


def action_space_text(spec: ActionSpec) -> str:
    """The action space as a Hello carries it (JSON): the server compares it with its own."""
    return json.dumps(spec.signature(), sort_keys=True)


def channel_options(max_message_bytes: int) -> list:
    """gRPC options both ends of a stream use (server and client)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Notice a vanished peer (a machine that went away without closing the connection).
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def encode_array(array: np.ndarray, message=None):
    message = Array() if message is None else message
    message.data = np.ascontiguousarray(array).tobytes()
    message.dtype = array.dtype.name
    message.shape[:] = array.shape
    return message


def decode_array(message, name: str, dtype: str, shape: tuple) -> np.ndarray:
    """The array in message, which must have exactly this dtype and shape.

    A read-only view of the message's bytes, not a copy: every frame is copied into the unrolls
    anyway, and a copy per step is what a fast server cannot afford.
    """
    if message.dtype != dtype or tuple(message.shape) != tuple(shape):
        raise WireError(f"{name}: expected {dtype} {list(shape)}, got {message.dtype or '?'} {list(message.shape)}")
    data = message.data
    if len(data) != math.prod(shape) * np.dtype(dtype).itemsize:
        raise WireError(f"{name}: {len(data)} bytes do not make a {dtype} array of shape {list(shape)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def parse(message_class, raw: bytes):
    message = message_class()
    try:
        message.ParseFromString(raw)
    except (DecodeError, RuntimeError, ValueError) as error:
        raise WireError(f"not a {message_class.__name__} ({error})") from None
    return message


def encode_step(outputs: dict) -> bytes:
    # A fresh message each step: reassigning a reused message's bytes fields grows its arena (slower).
    message = ClientMessage()
    for key in STEP_KEYS:
        encode_array(outputs[key], getattr(message.step, key))
    return message.SerializeToString()


def decode_step(message, num_envs: int, step_specs: dict, actions: ActionSpec) -> dict:
    """A ClientMessage's Step as arrays [num_envs, ...]; checks types, shapes and value ranges.

    step_specs: key -> (per-step shape, numpy dtype) of the env keys (layout.numpy_specs(spec, ENV))."""
    if message.WhichOneof("kind") != "step":
        raise WireError(f"expected a step, got {message.WhichOneof('kind') or 'an empty message'}")
    step = message.step
    arrays = {
        key: decode_array(getattr(step, key), key, dtype.name, (num_envs, *shape))
        for key, (shape, dtype) in step_specs.items()
    }
    try:
        check(actions, arrays["last_action"], "last_action")
    except ActionError as error:
        raise WireError(str(error)) from None
    if not (np.isfinite(arrays["reward"]).all() and np.isfinite(arrays["episode_return"]).all()):
        raise WireError("reward and episode_return must be finite")
    frame = arrays["frame"]
    if frame.dtype.kind in "fc" and not np.isfinite(frame).all():
        raise WireError(f"frame has non-finite values (NaN/inf) for envs {_bad_rows(frame).tolist()}")
    return arrays


def _bad_rows(frame: np.ndarray) -> np.ndarray:
    return np.flatnonzero(~np.isfinite(frame.reshape(len(frame), -1)).all(axis=1))


def decode_actions(message, num_envs: int, spec: ActionSpec) -> np.ndarray:
    """The actions a client is sent, [num_envs, *step_shape], checked against its env's space."""
    actions = decode_array(message, "actions", spec.dtype, (num_envs, *spec.step_shape)).copy()
    try:
        check(spec, actions)
    except ActionError as error:
        raise WireError(str(error)) from None
    return actions
