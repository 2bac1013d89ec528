"""Plain ZeroMQ: multipart messages read and sent frame by frame, what a reader keeps of a
message (:class:`Bounds`, :class:`Cut`), what a frame takes on the wire, and a blocking view
of a context.

The lowest room of the bus with :mod:`opentinker.bus.logs`: it imports nothing else of it, so
the blocking client, the asyncio loop, the pipelines and the held-bytes watch all read and send
through the same functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import zmq

from protocols.codec import BIG_BUFFERS

# Plain ints: pyzmq's flag enums cost an enum construction per ``|`` (half of a small
# send_multipart/recv_multipart pair on Python 3.11).
NOBLOCK, SNDMORE, EVENTS, POLLIN = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.EVENTS), int(zmq.POLLIN)
RCVMORE = int(zmq.RCVMORE)


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """``send_multipart(frames, flags, copy=False)`` without the enum arithmetic (pyzmq still
    copies frames under its copy threshold and sends larger ones without copying)."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        sock.send(f, flags | SNDMORE if i < last else flags, copy=False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``recv_multipart(flags, copy=False)``, reading ``more`` from each frame."""
    f = sock.recv(flags, copy=False)
    parts = [f]
    while f.more:
        f = sock.recv(flags, copy=False)
        parts.append(f)
    return parts


class Bounds(NamedTuple):
    """What :func:`recv_bounded` keeps of one multipart message: at most ``parts`` frames of
    ``nbytes`` bytes in all; of a message over either, only its first ``keep`` frames (the
    identity and header a reply needs)."""

    parts: int
    nbytes: int
    keep: int = 1


class Cut(NamedTuple):
    """A message :func:`recv_bounded` did not keep whole: ``why`` (``frames``: more than
    ``Bounds.parts``; ``bytes``: more than ``Bounds.nbytes``), and how many frames and bytes it
    had in all (every frame read, the dropped ones freed as they were read), and the bytes it
    took on the wire: each frame with its ZMTP header (``wire``), and on CURVE inside its
    MESSAGE command (``wire_curve``; :func:`frame_wire`)."""

    why: str
    parts: int
    nbytes: int
    wire: int = 0
    wire_curve: int = 0


CURVE_FRAME = 33
"""Bytes CURVE adds to each frame: a MESSAGE command (``\\x07MESSAGE``, an 8-byte nonce, a
16-byte MAC and a flags byte around the data), itself sent as a ZMTP frame."""


def frame_wire(size: int, curve: bool = False) -> int:
    """Bytes one frame of ``size`` bytes takes on the wire: its data and its ZMTP header (2
    bytes up to 255 bytes, else 9), on CURVE of the MESSAGE command that carries it."""
    if curve:
        size += CURVE_FRAME
    return size + (2 if size < 256 else 9)


_DISCARD = bytearray()
"""``recv_into`` an empty buffer discards a frame without making a ``zmq.Frame`` of it."""


def recv_bounded(sock: zmq.Socket, bounds: Bounds, flags: int = 0,
                 on_large: Callable[[], None] | None = None) -> tuple[list[zmq.Frame], Cut | None]:
    """One multipart message, read frame by frame: ``(frames, None)``, or, for a message over
    ``bounds``, ``(its first bounds.keep frames, Cut)``: the frames past the bound are read and
    freed one at a time, never held together (libzmq hands a message over once all of it has
    arrived; this bounds what the reader adds to that). ``on_large()`` is called once the
    message has ``BIG_BUFFERS`` frames, before the next is read."""
    f = sock.recv(flags, copy=False)
    parts = [f]
    size = len(f)
    max_parts, max_bytes = bounds.parts, bounds.nbytes
    while f.more:
        if len(parts) >= max_parts or size > max_bytes:
            break
        if len(parts) == BIG_BUFFERS and on_large is not None:
            on_large()
        f = sock.recv(flags, copy=False)
        parts.append(f)
        size += len(f)
    else:
        if size <= max_bytes:
            return parts, None
    why = "bytes" if size > max_bytes else "frames"
    n, more = len(parts), f.more
    wire = wire_curve = 0
    for f in parts:
        wire, wire_curve = wire + frame_wire(len(f)), wire_curve + frame_wire(len(f), True)
    del parts[bounds.keep:]
    del f
    recv_into = getattr(sock, "recv_into", None)  # pyzmq >= 26.4
    while more:
        if recv_into is not None:
            one = recv_into(_DISCARD, flags=flags)
            more = sock.getsockopt(RCVMORE)
        else:
            f = sock.recv(flags, copy=False)
            one = len(f)
            more = f.more
            del f
        size += one
        wire, wire_curve = wire + frame_wire(one), wire_curve + frame_wire(one, True)
        n += 1
    return parts, Cut(why, n, size, wire, wire_curve)


def plain_context(ctx: zmq.Context) -> zmq.Context:
    """A blocking-API view of ``ctx`` (the same libzmq context, so ``inproc://`` works)."""
    return ctx if type(ctx) is zmq.Context else zmq.Context.shadow(ctx.underlying)
