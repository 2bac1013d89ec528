"""The message bus: typed ZeroMQ request-reply (ROUTER/DEALER) and PUSH/PULL.

* :class:`Server` (``server.py``): sessions (``Hello`` with the protocol version), a task per
  request, idempotent state-changing requests (per peer and request id), cancellation,
  heartbeats, bounded work, bounded cost per message (``protocols.codec.Limits``, read frame
  by frame), typed ``Error`` replies and counters for every bad frame.
* :class:`Client` (asyncio, ``client.py``) and :class:`SyncClient` (blocking, ``sync.py``):
  many requests in flight, per-request timeouts that cancel on the server, ``PeerLost`` after
  3 silent heartbeats, polling for fast replies (:class:`ReplyPolling`), and an
  ``on_partial`` callback per request for streamed partial results. Both are I/O around one
  :class:`ClientState` (``client_state.py``, no sockets): the session (``Hello``, the retry
  after ``no_handshake``), which reply answers which request, partial results, heartbeats and
  the counters.
* :class:`Emitter` (``stream.py``): what a handler gets from :meth:`Server.emitter` to send
  partial results (``SampleChunk``) of its request, from any thread, bounded and never
  blocking; the final reply always comes last.
* :class:`Pusher` / :class:`Puller` (``pipeline.py``): one-way messages (trajectories); PUSH
  round-robins and never fans out, so each learner binds its own PULL.
* :class:`LoopThread` (``loop.py``): an asyncio loop in a daemon thread, so a component serves the bus
  while its owner (a Ray actor method, a test) blocks;
  :func:`settle_heap`, for a component to call once it has loaded what it keeps (full garbage
  collections then skip it), and :func:`unsettle_heap` when it stops.
* ``common.py``: endpoint rules (``tcp://``, ``ipc://``, ``inproc://``; no non-loopback bind
  without CURVE keys), :class:`CurveKeys`, socket options (``LINGER=0``, high-water marks, a
  frame-size cap), what a reader keeps of a message, and the heartbeat counter.
* ``auth.py`` (who may connect: PLAIN with the run's secret, CURVE), ``held.py`` (what libzmq
  holds of a peer's unfinished message), and at the bottom ``frames.py`` (multipart messages
  read and sent frame by frame) and ``logs.py`` (:class:`~opentinker.bus.logs.LogEvery`).
  Imports run one way, each module only from those below it: ``frames``, ``logs`` <
  ``auth``, ``held`` < ``common``, ``loop`` < ``stream``, ``client_state`` < ``client``,
  ``sync``, ``server``, ``pipeline``.

The protocol itself is in ``protocols/`` and ``docs/protocol.md``.
"""

from opentinker.bus.client import Client
from opentinker.bus.client_state import ClientState, next_request_id
from opentinker.bus.common import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_SPIN_S,
    LOOPBACK,
    MISSED_BEATS,
    BeatCounter,
    Counters,
    CurveKeys,
    PeerLost,
    ProtocolMismatch,
    RemoteError,
    ReplyPolling,
    check_bind,
    is_loopback,
)
from opentinker.bus.loop import LoopThread, new_event_loop, settle_heap, unsettle_heap
from opentinker.bus.pipeline import Puller, Pusher
from opentinker.bus.server import Handler, Server
from opentinker.bus.stream import Emitter, wants_stream
from opentinker.bus.sync import SyncClient

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_SPIN_S",
    "LOOPBACK",
    "MISSED_BEATS",
    "BeatCounter",
    "Client",
    "ClientState",
    "Counters",
    "CurveKeys",
    "Emitter",
    "Handler",
    "LoopThread",
    "PeerLost",
    "ProtocolMismatch",
    "Puller",
    "Pusher",
    "RemoteError",
    "ReplyPolling",
    "Server",
    "SyncClient",
    "check_bind",
    "is_loopback",
    "new_event_loop",
    "next_request_id",
    "settle_heap",
    "unsettle_heap",
    "wants_stream",
]
