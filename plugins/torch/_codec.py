"""Optimizer state_dict <-> (JSON skeleton, list of tensors), so it crosses the wire without pickle.

Tagged JSON keeps the types a state_dict uses: dict keys may be ints, tuples stay tuples
(Adam's betas), tensors are replaced by their index into a separate list.
"""

from __future__ import annotations

import json
from typing import Any

import torch

_SCALARS = (type(None), bool, int, float, str)


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {
            "x": len(tensors) - 1,
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "device": value.device.type,
        }
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, dict):
        return {"d": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"t": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return {"l": [_encode(v, tensors) for v in value]}
    raise TypeError(
        f"cannot send a {type(value).__name__} in an optimizer state_dict; only tensors and plain data"
    )


def encode(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Splits `state` into a JSON skeleton and the tensors it holds, in order."""
    tensors: list[torch.Tensor] = []
    skeleton = _encode(state, tensors)
    return json.dumps(skeleton, separators=(",", ":")).encode(), tensors


def _tensor_nodes(skeleton: bytes) -> list[dict[str, Any]]:
    """The skeleton's tensor placeholders, in index order."""
    nodes: dict[int, dict[str, Any]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "x" in node:
                nodes[node["x"]] = node
            else:
                for child in node.values():
                    walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(json.loads(skeleton))
    return [nodes[i] for i in range(len(nodes))]


def tensor_specs(skeleton: bytes) -> list[tuple[torch.dtype, list[int]]]:
    """(dtype, shape) of each tensor the skeleton refers to, in index order."""
    return [(getattr(torch, node["dtype"]), node["shape"]) for node in _tensor_nodes(skeleton)]


def tensor_devices(skeleton: bytes) -> list[str]:
    """The device type ("cpu", "cuda") each tensor had when encoded, in index order."""
    return [node.get("device", "cpu") for node in _tensor_nodes(skeleton)]


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "x" in node:
            return tensors[node["x"]]
        if "d" in node:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in node["d"]}
        if "t" in node:
            return tuple(_decode(v, tensors) for v in node["t"])
        return [_decode(v, tensors) for v in node["l"]]
    return node


def decode(skeleton: bytes, tensors: list[torch.Tensor]) -> Any:
    """Rebuilds the state from its skeleton and tensors."""
    return _decode(json.loads(skeleton), tensors)
