"""Gradient compression as Horovod spells it: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``.

A compressor has ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``.
The built-in ones also name the dtype they put on the wire, so DistributedOptimizer hands
that dtype to the scheduler (which prescales averages in full precision before casting);
the strings "none", "fp16" and "bf16" and None are accepted wherever a compressor is.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface for compressing and decompressing a tensor (Horovod's Compressor)."""

    wire_dtype: torch.dtype | None = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Returns the tensor to send and what decompress() needs to restore it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Restores a received tensor from its compressed form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Returns the tensor unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Returns the tensor unchanged."""
        return tensor


class _CastCompressor(Compressor):
    """Casts floating tensors to `wire_dtype` on the wire and back afterwards."""

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        """Floating tensors in the wire dtype; others unchanged."""
        assert cls.wire_dtype is not None
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The tensor in its original dtype."""
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating tensors as float16."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends floating tensors as bfloat16."""

    wire_dtype = torch.bfloat16


class Compression:
    """The built-in compressors, as in ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_BY_NAME: dict[Any, type[Compressor]] = {
    None: NoneCompressor,
    "none": NoneCompressor,
    "fp16": FP16Compressor,
    "bf16": BF16Compressor,
}


def compressor(compression: Any) -> Any:
    """The compressor for `compression` (a Compression member, a compressor, a name or None)."""
    if isinstance(compression, str) or compression is None:
        if compression not in _BY_NAME:
            raise ValueError(
                f'compression must be Compression.none, Compression.fp16, Compression.bf16 (or "none", "fp16", '
                f'"bf16", None), not {compression!r}'
            )
        return _BY_NAME[compression]
    if callable(getattr(compression, "compress", None)) and callable(
        getattr(compression, "decompress", None)
    ):
        return compression
    raise TypeError(
        f"compression must be a compressor with compress() and decompress() (e.g. Compression.fp16) or one of "
        f'"none", "fp16", "bf16", not {compression!r}'
    )


def wire_dtype(compression: Any) -> torch.dtype | None:
    """The dtype a built-in compressor puts on the wire (None: as is); TypeError for a custom one."""
    chosen = compressor(compression)
    if chosen in (NoneCompressor, FP16Compressor, BF16Compressor):
        return chosen.wire_dtype
    raise TypeError(
        f"DistributedOptimizer takes Compression.none, Compression.fp16 or Compression.bf16, not the custom "
        f"compressor {getattr(chosen, '__name__', chosen)!r}: gradients are cast on the wire by the scheduler; "
        "for a custom compressor call commsched.torch.allreduce(tensor, compression=...) yourself"
    )
