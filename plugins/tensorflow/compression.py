"""Gradient compression as Horovod spells it for TensorFlow: Compression.none, .fp16, .bf16.

A compressor has ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``; the
built-in ones cast floating tensors to a 16-bit type for the wire and back. The strings
"none", "fp16", "bf16" and None are accepted wherever a compressor is.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """Interface for compressing and decompressing a tensor (Horovod's Compressor)."""

    wire_dtype: Any = None

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Returns the tensor to send and what decompress() needs to restore it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Restores a received tensor from its compressed form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Returns the tensor unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Returns the tensor unchanged."""
        return tensor


class _CastCompressor(Compressor):
    @classmethod
    def compress(cls, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:  # type: ignore[override]
        """Floating tensors in the wire dtype; others unchanged."""
        if tensor.dtype.is_floating and tensor.dtype != cls.wire_dtype:
            return tf.cast(tensor, cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """The tensor in its original dtype."""
        return tensor if ctx is None else tf.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating tensors as float16."""

    wire_dtype = tf.float16


class BF16Compressor(_CastCompressor):
    """Sends floating tensors as bfloat16."""

    wire_dtype = tf.bfloat16


class Compression:
    """The built-in compressors, as in ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_BY_NAME = {None: NoneCompressor, "none": NoneCompressor, "fp16": FP16Compressor, "bf16": BF16Compressor}


def compressor(compression: Any) -> Any:
    """The compressor for `compression` (a Compression member, a compressor, a name or None)."""
    if compression is None or isinstance(compression, str):
        if compression not in _BY_NAME:
            raise ValueError(
                'compression must be Compression.none, Compression.fp16, Compression.bf16 (or "none", "fp16", '
                f'"bf16", None), not {compression!r}'
            )
        return _BY_NAME[compression]
    if callable(getattr(compression, "compress", None)) and callable(
        getattr(compression, "decompress", None)
    ):
        return compression
    raise TypeError(f"compression must be a compressor with compress() and decompress(), not {compression!r}")
