"""Protobuf messages of the gRPC transport, built from a descriptor that mirrors grpc_wire.proto.

Building the descriptor here instead of committing protoc output keeps commsched working with any
protobuf runtime from 3.20 on: generated code refuses runtimes older than the protoc that made it,
and the TensorFlow plug-in pins older runtimes. tests/test_grpc_wire.py checks that this descriptor
and the one protoc compiles from grpc_wire.proto are the same.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "commsched.grpc"
SERVICE = "commsched.grpc.Transport"
FILE_NAME = "commsched/transports/grpc_wire.proto"

_F = descriptor_pb2.FieldDescriptorProto
# message -> [(field name, number, type, label, enum type name)]
_MESSAGES: dict[str, list[tuple[str, int, int, int, str]]] = {
    "JoinRequest": [
        ("rank", 1, _F.TYPE_UINT32, _F.LABEL_OPTIONAL, ""),
        ("size", 2, _F.TYPE_UINT32, _F.LABEL_OPTIONAL, ""),
        ("address", 3, _F.TYPE_STRING, _F.LABEL_OPTIONAL, ""),
    ],
    "JoinReply": [("addresses", 1, _F.TYPE_STRING, _F.LABEL_REPEATED, "")],
    "Frame": [
        ("channel", 1, _F.TYPE_ENUM, _F.LABEL_OPTIONAL, ".commsched.grpc.Frame.Channel"),
        ("src", 2, _F.TYPE_UINT32, _F.LABEL_OPTIONAL, ""),
        ("seq", 3, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("step", 4, _F.TYPE_UINT32, _F.LABEL_OPTIONAL, ""),
        ("piece", 5, _F.TYPE_UINT32, _F.LABEL_OPTIONAL, ""),
        ("dtype", 6, _F.TYPE_STRING, _F.LABEL_OPTIONAL, ""),
        ("offset", 7, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("count", 8, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
        ("payload", 9, _F.TYPE_BYTES, _F.LABEL_OPTIONAL, ""),
    ],
    "Ack": [],
}
CHANNELS = {"DATA": 0, "CONTROL": 1, "ABORT": 2, "CLOSE": 3}


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto of grpc_wire.proto, built by hand."""
    proto = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    for name, fields in _MESSAGES.items():
        message = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = message.field.add(name=field_name, number=number, type=kind, label=label)
            field.json_name = "".join(p.capitalize() if i else p for i, p in enumerate(field_name.split("_")))
            if type_name:
                field.type_name = type_name
        if name == "Frame":
            enum = message.enum_type.add(name="Channel")
            for value_name, value in CHANNELS.items():
                enum.value.add(name=value_name, number=value)
    return proto


def _classes() -> dict[str, Any]:
    # A private pool: the default one may already hold a protoc-generated copy of this file.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor())
    found = {}
    for name in _MESSAGES:
        descriptor = pool.FindMessageTypeByName(f"{PACKAGE}.{name}")
        if hasattr(message_factory, "GetMessageClass"):
            found[name] = message_factory.GetMessageClass(descriptor)
        else:  # protobuf < 4.22
            found[name] = message_factory.MessageFactory(pool).GetPrototype(descriptor)
    return found


_BUILT = _classes()
JoinRequest: Any = _BUILT["JoinRequest"]
JoinReply: Any = _BUILT["JoinReply"]
Frame: Any = _BUILT["Frame"]
Ack: Any = _BUILT["Ack"]
DATA, CONTROL, ABORT, CLOSE = (CHANNELS[name] for name in ("DATA", "CONTROL", "ABORT", "CLOSE"))
