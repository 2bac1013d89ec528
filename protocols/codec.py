"""Encode a message as frames ``[header, body, *buffers]`` and decode it back, typed.

* ``header``: msgpack ``[PROTOCOL_VERSION, request_id, n_buffers]``.
* ``body``: msgpack of the message Struct (tagged by class name); each ``numpy.ndarray`` field
  is replaced by an :class:`ArrayRef` ``[dtype, shape, index]`` that names its buffer.
* ``buffers``: the arrays' raw bytes, C-contiguous, little-endian; sent without copies (``zmq`` takes the
  ``memoryview``) and wrapped without copies on receipt (read-only views of the frame). Each
  buffer is named by exactly one ``ArrayRef``.

Decoding is typed and bounded: an unknown tag, a wrong field type, a bad dtype, a buffer of the
wrong size or a message over a :class:`Limits` bound raise :class:`DecodeError` with an
:class:`~protocols.messages.ErrorCode` that names what was wrong. No pickle, ever.

What a message may cost the receiver is bounded before the work it would cause
(:class:`Limits`): the number of frames and their bytes are checked before the body is read,
the body's bytes before it is decoded, an array's dimensions before their product is taken,
and every buffer is wrapped at most once, so decoding time and memory grow linearly with the
bytes received. Declared lengths (of a list, map, string or the header's buffer count) are
checked against the bytes actually there before anything is allocated for them; nesting
deeper than the decoder's recursion guard is a ``bad_message``.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import reprlib
import threading
from typing import Any, Sequence

import msgspec
import numpy as np

from protocols.messages import PROTOCOL_VERSION, ErrorCode, Message

ALLOWED_DTYPES = frozenset({"int32", "int64", "float32", "float64", "uint8", "bool", "float16"})
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
MAX_HEADER_BYTES = 32
"""A header is three msgpack integers: at most 28 bytes."""
MAX_ERROR_CHARS = 300
"""A :class:`DecodeError`'s text is cut to this many characters (it goes back to the peer and
into the log, and may quote what the peer sent)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one message may cost its receiver; each bound is checked before the work it bounds.

    A message over a bound is refused with a :class:`DecodeError` (``too_large`` for a size or a
    count, ``bad_message`` for an array's rank), never decoded further.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    """All frames of a message together (header, body and buffers)."""
    max_buffers: int = 4096
    """Array buffers in a message (frames after the body), i.e. arrays it carries."""
    max_body_bytes: int = 128 * 1024
    """The msgpack body: everything but the arrays' bytes. Decoding it costs at most some
    hundred nanoseconds per byte (a byte can be an empty list), so this bounds the time one
    message holds the decoding thread."""
    max_ndim: int = 8
    """Dimensions of one array (its ``shape``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v, least = getattr(self, f.name), 0 if f.name == "max_buffers" else 1
            if type(v) is not int or v < least:
                raise ValueError(f"Limits.{f.name} must be an int >= {least}, got {v!r}")

    @property
    def max_frames(self) -> int:
        """Frames in a message: header, body and ``max_buffers`` buffers."""
        return 2 + self.max_buffers

    def with_max_bytes(self, max_bytes: int | None) -> Limits:
        """These limits, with ``max_bytes`` replaced when given."""
        return self if max_bytes is None or max_bytes == self.max_bytes else dataclasses.replace(self, max_bytes=max_bytes)


DEFAULT_LIMITS = Limits()


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
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS - 3] + "..."
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
    """The header of a message; :class:`DecodeError` (``bad_frame``, ``bad_version``) when it
    cannot be read or speaks another protocol version."""
    if len(frame) > MAX_HEADER_BYTES:
        raise DecodeError(ErrorCode.BAD_FRAME, f"header of {len(frame)} bytes (at most {MAX_HEADER_BYTES})")
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


def check_sizes(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Header:
    """The header of ``frames``, once their count and sizes are within ``limits`` (else
    :class:`DecodeError`): everything :func:`decode` checks before it reads the body."""
    if len(frames) < 2:
        raise DecodeError(ErrorCode.BAD_FRAME, f"expected >= 2 frames, got {len(frames)}")
    header = decode_header(frames[0])
    rid = header.request_id
    if len(frames) > limits.max_frames:
        raise DecodeError(ErrorCode.TOO_LARGE,
                          f"message of {len(frames)} frames > limit {limits.max_frames} (max_buffers {limits.max_buffers})", rid)
    size = sum(map(len, frames))
    if size > limits.max_bytes:
        raise DecodeError(ErrorCode.TOO_LARGE, f"message of {size} bytes > limit {limits.max_bytes}", rid)
    if len(frames[1]) > limits.max_body_bytes:
        raise DecodeError(ErrorCode.TOO_LARGE,
                          f"body of {len(frames[1])} bytes > limit {limits.max_body_bytes} (max_body_bytes)", rid)
    if len(frames) - 2 != header.n_buffers:
        raise DecodeError(
            ErrorCode.BAD_FRAME, f"header names {header.n_buffers} buffers, got {len(frames) - 2}", rid
        )
    return header


BIG_BODY = 64 * 1024
BIG_BUFFERS = 1024
"""A message with a body or a buffer count above these is decoded with the cyclic garbage
collector paused (:func:`gc_pause`)."""


def decode(
    frames: Sequence[bytes | memoryview],
    max_bytes: int | None = None,
    type: Any = Message,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[int, Any]:
    """``(request_id, message)`` from frames made by :func:`encode`; raises :class:`DecodeError`.

    ``limits`` bound what the message may cost (``max_bytes``, when given, replaces
    ``limits.max_bytes``)."""
    limits = limits.with_max_bytes(max_bytes)
    header = check_sizes(frames, limits)
    rid = header.request_id
    buffers = frames[2:]
    body = frames[1]
    state = _local.__dict__
    state["buffers"] = buffers
    state["used"] = bytearray(len(buffers))
    state["max_ndim"] = limits.max_ndim
    pause = (len(body) > BIG_BODY or len(buffers) > BIG_BUFFERS) and gc_pause()
    try:
        msg = _decoder(type).decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        code = ErrorCode.UNKNOWN_TYPE if "Invalid value" in text and "$.type" in text else ErrorCode.BAD_MESSAGE
        raise DecodeError(code, text, rid) from None
    except msgspec.DecodeError as e:
        raise DecodeError(ErrorCode.BAD_FRAME, f"unreadable body: {e}", rid) from None
    except RecursionError:
        raise DecodeError(ErrorCode.BAD_MESSAGE, "body nested deeper than the decoder's recursion limit", rid) from None
    finally:
        if pause:
            gc_resume()
        used = state["used"]
        state["buffers"] = ()
        state["used"] = b""
    if buffers and used.count(0):
        raise DecodeError(ErrorCode.BAD_MESSAGE, f"buffer {used.index(0)} is named by no array reference", rid)
    return rid, msg


_local = threading.local()
"""Per thread: the buffers of the message being decoded (and which of them an array reference
already took), and a cached decoder per type (msgspec's ``decode(..., type=...)`` re-reads a
30-member union every call: ~40 us vs ~0.4 us)."""

_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


def gc_pause() -> bool:
    """Pause the cyclic garbage collector until the matching :func:`gc_resume` (pauses nest,
    also across threads; the collector runs again after the last one, if it ran before the
    first). Returns True.

    For reading one large message: the collector's passes over the objects made so far would
    otherwise run every few hundred of them, make decoding a body of many small containers
    (or a message of many frames) cost more than linear time, and move what a peer sent into
    the old generation, whose full collections cost in proportion to the whole process."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    return True


def gc_resume() -> None:
    """End one :func:`gc_pause`."""
    global _gc_pauses
    with _gc_lock:
        _gc_pauses -= 1
        if _gc_pauses == 0 and _gc_was_enabled:
            gc.enable()


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
    """An :class:`ArrayRef` in the body -> a read-only array over its buffer, no copy.

    Checked in the order of their cost, each before what it guards: the reference's form, its
    dtype, its buffer index (in range and not taken by another reference), its rank (at most
    ``Limits.max_ndim``), then its size against the buffer's."""
    if tp is not np.ndarray:
        raise NotImplementedError(f"cannot decode type {tp}")
    state = _local.__dict__
    buffers = state["buffers"]
    # An ArrayRef is [dtype, shape, index]; checked by hand (msgspec.convert costs microseconds).
    if type(obj) is not list or len(obj) != 3:
        raise ValueError(f"an array reference is [dtype, shape, index], got {_short(obj)}")
    name, shape, index = obj
    dt = _NUMPY_DTYPES.get(name) if type(name) is str else None
    if dt is None:
        raise ValueError(f"dtype {_short(name)} not allowed")
    if type(index) is not int or not 0 <= index < len(buffers):
        raise ValueError(f"buffer index {_short(index)} out of range")
    used = state["used"]
    if used[index]:
        raise ValueError(f"buffer {index} is named by a second array reference")
    if type(shape) is not list:
        raise ValueError(f"shape {_short(shape)} is not a list of sizes >= 0")
    if len(shape) == 1:  # the common case, checked without a generator
        n = shape[0]
        if type(n) is not int or n < 0:
            raise ValueError(f"shape {_short(shape)} is not a list of sizes >= 0")
    else:
        if len(shape) > state["max_ndim"]:
            raise ValueError(f"shape has {len(shape)} dimensions > limit {state['max_ndim']} (max_ndim)")
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"shape {_short(shape)} is not a list of sizes >= 0")
        n = math.prod(shape)  # at most max_ndim factors of 64 bits each
    buf = buffers[index]
    if n * dt.itemsize != len(buf):
        raise ValueError(
            f"buffer {index} holds {len(buf)} bytes, shape {tuple(shape)} of {name} needs {n * dt.itemsize}"
        )
    used[index] = 1
    arr = np.frombuffer(buf, dtype=dt)
    return arr if len(shape) == 1 else arr.reshape(shape)


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxlist, _repr.maxdict, _repr.maxstring, _repr.maxother = 2, 4, 4, 40, 40


def _short(obj: Any) -> str:
    """``repr(obj)`` of a value from the wire, in bounded time and length (a long or deeply
    nested list is not rendered whole)."""
    return _repr.repr(obj)
