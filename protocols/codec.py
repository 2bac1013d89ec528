"""Encode a message as frames ``[header, body, *buffers]`` and decode it back, typed.

* ``header``: msgpack ``[PROTOCOL_VERSION, request_id, n_buffers]``.
* ``body``: msgpack of the message Struct (tagged by class name); each ``numpy.ndarray`` field
  is replaced by an :class:`ArrayRef` ``[dtype, shape, index]`` that names its buffer.
* ``buffers``: the arrays' raw bytes, C-contiguous, little-endian; sent without copies (``zmq`` takes the
  ``memoryview``) and wrapped without copies on receipt (read-only views of the frame).

Decoding is typed and bounded: an unknown tag, a wrong field type, a bad dtype, a buffer of the
wrong size or a message over ``max_bytes`` raise :class:`DecodeError` with an
:class:`~protocols.messages.ErrorCode` that names what was wrong. No pickle, ever.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Sequence

import msgspec
import numpy as np

from protocols.messages import PROTOCOL_VERSION, ErrorCode, Message

ALLOWED_DTYPES = frozenset({"int32", "int64", "float32", "float64", "uint8", "bool", "float16"})
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class ArrayRef(msgspec.Struct, array_like=True, frozen=True):
    dtype: str
    shape: tuple[int, ...]
    index: int


class Header(msgspec.Struct, array_like=True, frozen=True):
    version: int
    request_id: int
    n_buffers: int


class DecodeError(ValueError):
    """A frame could not be decoded; ``code`` says why, ``request_id`` is set when known."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.request_id = request_id


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)


_WIRE_DTYPES = {np.dtype(name).newbyteorder("<"): name for name in ALLOWED_DTYPES}
"""Little-endian dtype (the wire's byte order) -> its wire name (a dict lookup:
``dtype.name`` costs microseconds)."""
_NUMPY_DTYPES = {name: dt for dt, name in _WIRE_DTYPES.items()}


def encode(msg: Message, request_id: int = 0) -> list[Any]:
    """Frames for ``msg``: ``[header_bytes, body_bytes, *array_buffers]``. Arrays travel
    little-endian (another byte order is converted first)."""
    buffers: list[memoryview] = []

    def enc_hook(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            name = _WIRE_DTYPES.get(arr.dtype)
            if name is None:
                if arr.dtype.newbyteorder("<") not in _WIRE_DTYPES:
                    raise TypeError(f"array dtype {arr.dtype} is not allowed on the wire")
                arr = arr.astype(arr.dtype.newbyteorder("<"))
                name = _WIRE_DTYPES[arr.dtype]
            buffers.append(memoryview(arr).cast("B"))
            return ArrayRef(name, arr.shape, len(buffers) - 1)
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")

    body = msgspec.msgpack.encode(msg, enc_hook=enc_hook)
    header = _header_encoder.encode(Header(PROTOCOL_VERSION, request_id, len(buffers)))
    return [header, body, *buffers]


def decode_header(frame: bytes | memoryview) -> Header:
    try:
        header = _header_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(ErrorCode.BAD_FRAME, f"unreadable header: {e}") from None
    if header.version != PROTOCOL_VERSION:
        raise DecodeError(
            ErrorCode.BAD_VERSION,
            f"peer speaks protocol {header.version}, this side {PROTOCOL_VERSION}",
            header.request_id,
        )
    return header


_array_ref_decoder = msgspec.msgpack.Decoder(ArrayRef)


def decode(
    frames: Sequence[bytes | memoryview],
    max_bytes: int = DEFAULT_MAX_BYTES,
    type: Any = Message,
) -> tuple[int, Any]:
    """``(request_id, message)`` from frames made by :func:`encode`; raises :class:`DecodeError`."""
    if len(frames) < 2:
        raise DecodeError(ErrorCode.BAD_FRAME, f"expected >= 2 frames, got {len(frames)}")
    size = sum(len(f) for f in frames)
    header = decode_header(frames[0])
    rid = header.request_id
    if size > max_bytes:
        raise DecodeError(ErrorCode.TOO_LARGE, f"message of {size} bytes > limit {max_bytes}", rid)
    buffers = frames[2:]
    if len(buffers) != header.n_buffers:
        raise DecodeError(
            ErrorCode.BAD_FRAME, f"header names {header.n_buffers} buffers, got {len(buffers)}", rid
        )

    _local.buffers = buffers
    try:
        msg = _decoder(type).decode(frames[1])
    except msgspec.ValidationError as e:
        text = str(e)
        code = ErrorCode.UNKNOWN_TYPE if "Invalid value" in text and "$.type" in text else ErrorCode.BAD_MESSAGE
        raise DecodeError(code, text, rid) from None
    except msgspec.DecodeError as e:
        raise DecodeError(ErrorCode.BAD_FRAME, f"unreadable body: {e}", rid) from None
    finally:
        _local.buffers = ()
    return rid, msg


_local = threading.local()
"""Per thread: the buffers of the message being decoded, and a cached decoder per type
(msgspec's ``decode(..., type=...)`` re-reads a 30-member union every call: ~40 us vs ~0.4 us)."""


def _decoder(tp: Any) -> msgspec.msgpack.Decoder:
    cache = getattr(_local, "decoders", None)
    if cache is None:
        cache = _local.decoders = {}
    key = id(tp)  # hashing a typing.Union costs microseconds; ids of cached types stay put
    dec = cache.get(key)
    if dec is None:
        dec = cache[key] = msgspec.msgpack.Decoder(tp, dec_hook=_dec_hook)
        _local.keep = [*getattr(_local, "keep", []), tp]  # the id stays this type's
    return dec


def _dec_hook(tp: Any, obj: Any) -> Any:
    """An :class:`ArrayRef` in the body -> a read-only array over its buffer, no copy."""
    if tp is not np.ndarray:
        raise NotImplementedError(f"cannot decode type {tp}")
    buffers = _local.buffers
    # An ArrayRef is [dtype, shape, index]; checked by hand (msgspec.convert costs microseconds).
    if type(obj) is not list or len(obj) != 3:
        raise ValueError(f"an array reference is [dtype, shape, index], got {obj!r:.80}")
    name, shape, index = obj
    dt = _NUMPY_DTYPES.get(name) if type(name) is str else None
    if dt is None:
        raise ValueError(f"dtype {name!r:.40} not allowed")
    if type(index) is not int or not 0 <= index < len(buffers):
        raise ValueError(f"buffer index {index!r:.40} out of range")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"shape {shape!r:.80} is not a list of sizes >= 0")
    buf = buffers[index]
    n = math.prod(shape)
    if n * dt.itemsize != len(buf):
        raise ValueError(
            f"buffer {index} holds {len(buf)} bytes, shape {tuple(shape)} of {name} needs {n * dt.itemsize}"
        )
    arr = np.frombuffer(buf, dtype=dt)
    return arr if len(shape) == 1 else arr.reshape(shape)
