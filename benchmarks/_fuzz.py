"""Fuzz inputs shared by tests/transport/test_fuzz.py and benchmarks/robustness.py: random and mutated coordinator
requests, and one call that checks the answer is a proper status (never UNKNOWN, the mark of an unhandled
exception)."""

from __future__ import annotations

import random
from typing import Any

import grpc

from paramplane.protos import coordinator_pb2

COORD = "/paramplane.v1.Coordinator/"
# Methods that cannot block on their own; Barrier and KV waits are fuzzed with bytes only (short deadline).
UNARY = [
    "Join",
    "KVSet",
    "KVGet",
    "KVAdd",
    "KVCompareSet",
    "KVDelete",
    "Heartbeat",
    "Abort",
    "Leave",
    "Status",
]
MESSAGES: dict[str, Any] = {
    "Join": coordinator_pb2.JoinRequest,
    "KVSet": coordinator_pb2.KVSetRequest,
    "KVAdd": coordinator_pb2.KVAddRequest,
    "KVCompareSet": coordinator_pb2.KVCompareSetRequest,
    "KVDelete": coordinator_pb2.KVDeleteRequest,
    "Heartbeat": coordinator_pb2.HeartbeatRequest,
    "Abort": coordinator_pb2.AbortRequest,
    "Leave": coordinator_pb2.LeaveRequest,
    "Status": coordinator_pb2.StatusRequest,
}


def mutated(rng: random.Random, cls: Any) -> bytes:
    """A message of ``cls`` with random values in random fields (extremes included), serialized."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if rng.random() < 0.3:
            continue
        if field.is_repeated or field.message_type is not None:
            continue
        kind = field.cpp_type
        if kind == field.CPPTYPE_STRING:
            value: Any = rng.choice(["", "x" * rng.randrange(1, 5000), "\u2603/../k", "a" * 64])
            if field.type == field.TYPE_BYTES:
                value = rng.randbytes(rng.randrange(0, 3000))
        elif kind == field.CPPTYPE_BOOL:
            value = rng.random() < 0.5
        elif kind in (field.CPPTYPE_INT32, field.CPPTYPE_ENUM):
            value = rng.choice([0, -1, 1, 2, 3, -(2**31), 2**31 - 1])
        elif kind in (field.CPPTYPE_INT64,):
            value = rng.choice([0, -1, 7, -(2**63), 2**63 - 1])
        elif kind in (field.CPPTYPE_UINT32, field.CPPTYPE_UINT64):
            value = rng.choice([0, 1, 2**32 - 1])
        elif kind in (field.CPPTYPE_FLOAT, field.CPPTYPE_DOUBLE):
            value = rng.choice([0.0, -1.0, 1e-9, 1e30, float("inf"), float("nan")])
        else:
            continue
        setattr(msg, field.name, value)
    data = msg.SerializeToString()
    if rng.random() < 0.2 and data:  # truncate or flip a byte: a broken encoding
        cut = bytearray(data[: rng.randrange(len(data))])
        if cut:
            cut[rng.randrange(len(cut))] ^= 0xFF
        data = bytes(cut)
    return data


def call(
    channel: grpc.Channel, method: str, payload: bytes, metadata: Any, timeout: float
) -> grpc.StatusCode:
    try:
        channel.unary_unary(COORD + method)(payload, metadata=metadata, timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
        assert code != grpc.StatusCode.UNKNOWN, f"{method}: unhandled error {err.details()}"
        if code == grpc.StatusCode.INTERNAL:  # only gRPC's own refusal to decode
            assert "deserializ" in (err.details() or "").lower(), f"{method}: {err.details()}"
        return code
