"""Who may talk on the bus: every socket authenticates its peers, loopback included.

* **PLAIN with the run's secret** (the default, every socket): a server accepts a connection
  only when the peer presents the user name ``opentinker`` and this run's secret; the check
  is ZeroMQ's ZAP handshake, so an unauthenticated process never gets a frame of its own
  decoded (libzmq drops the connection before any message is passed up). PLAIN sends the
  secret in clear text, which is why it is for loopback (and ``ipc://``) only.
* **CURVE** (``keys=CurveKeys``, required to bind a non-loopback address): authentication and
  encryption; a server with ``allowed_clients`` accepts only those public keys.

The run's secret is made once per process (``secrets.token_urlsafe(32)``) unless the
environment names one in ``OPENTINKER_BUS_SECRET``; it is put in this process's environment,
so processes started from it (Ray's raylet and its workers when this process starts Ray, a
benchmark's server processes) inherit it, and the runtime hands it to every actor it starts
(:mod:`opentinker.control.runtime`). A process's environment is readable only by its user
(``/proc/<pid>/environ`` is mode 0400); the secret is never written to a file or a log.

Each server socket's ZAP domain is its own (``<name>/<n>``), so a refused handshake is counted
on the server it was meant for (``auth_denied`` in its counters) and logged at most once a
second. One ZAP handler (pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator`, in its own
thread, so a busy event loop never stalls a handshake) serves each ZeroMQ context; it
compares secrets in constant time and never logs them.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import secrets
import threading
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

SECRET_ENV = "OPENTINKER_BUS_SECRET"
USERNAME = b"opentinker"
MIN_SECRET_CHARS = 32
MAX_SECRET_CHARS = 255
"""ZeroMQ's PLAIN carries at most 255 bytes of password."""

_secret: bytes | None = None
_lock = threading.Lock()


def _checked(value: str, where: str) -> bytes:
    if not MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS or not value.isascii() or not value.isprintable():
        raise ValueError(f"{where}: a bus secret is {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} printable ASCII "
                         f"characters (got {len(value)} characters)")
    return value.encode()


def run_secret() -> bytes:
    """This process's bus secret: ``$OPENTINKER_BUS_SECRET``, else made now and put there."""
    global _secret
    with _lock:
        if _secret is None:
            given = os.environ.get(SECRET_ENV)
            if given is not None:
                _secret = _checked(given, f"${SECRET_ENV}")
            else:
                made = secrets.token_urlsafe(32)
                os.environ[SECRET_ENV] = made
                _secret = made.encode()
        return _secret


def set_run_secret(value: str) -> None:
    """Use ``value`` as this process's bus secret (an actor, given the driver's): sockets made
    from now on present and accept it."""
    global _secret
    checked = _checked(value, "bus secret")
    with _lock:
        _secret = checked
        os.environ[SECRET_ENV] = value


def secure_client(sock: zmq.Socket) -> None:
    """Make a connecting socket present the run's secret (PLAIN)."""
    sock.plain_username = USERNAME
    sock.plain_password = run_secret()


# ------------------------------------------------------------------------------- server side

@dataclass
class _Domain:
    counters: dict
    """The server's counters: ``auth_denied`` is added to them."""
    where: str
    curve_allowed: frozenset[bytes] | None
    """CURVE public keys (Z85) this server accepts; ``None``: any key (CURVE itself then only
    authenticates the server) or PLAIN. ZAP hands the handler the raw 32-byte key."""


class _Handler(ThreadAuthenticator):
    """One ZAP handler per context: PLAIN against the run's secret, CURVE against each
    domain's allowed keys; refusals counted per domain."""

    def __init__(self, ctx: zmq.Context) -> None:
        from opentinker.bus.common import LogEvery  # common imports this module

        super().__init__(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.domains: dict[str, _Domain] = {}
        self._log = LogEvery(log)
        self._domain = ""
        """The domain of the request being answered (one at a time, in the handler's thread)."""

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        ok = (domain in self.domains and hmac.compare_digest(username.encode(), USERNAME)
              and hmac.compare_digest(password.encode(), run_secret()))
        return ok, b"OK" if ok else b"wrong credentials"

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        d = self.domains.get(domain)
        ok = d is not None and (d.curve_allowed is None or z85.encode(client_key) in d.curve_allowed)
        return ok, b"OK" if ok else b"key not allowed"

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        if status_code != b"200":
            d = self.domains.get(self._domain)
            if d is not None:
                d.counters["auth_denied"] = d.counters.get("auth_denied", 0) + 1
            self._log.warning("refused", "bus: refused a connection to %s: %s", d.where if d else "a server",
                              status_text.decode("ascii", "replace"))
        super()._send_zap_reply(request_id, status_code, status_text, user_id)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._domain = msg[2].decode("utf-8", "replace") if len(msg) > 2 else ""
        await super().handle_zap_message(msg)


_handlers: dict[int, _Handler] = {}
"""ZAP handler of each libzmq context (by its address); its ``domains`` are the sockets using it."""
_ids = itertools.count()


class Guard:
    """A server socket's registration with its context's ZAP handler; :meth:`close` it with
    the socket."""

    def __init__(self, ctx_addr: int, domain: str) -> None:
        self._ctx_addr, self.domain = ctx_addr, domain

    def close(self) -> None:
        with _lock:
            handler = _handlers.get(self._ctx_addr)
            if handler is None or handler.domains.pop(self.domain, None) is None or handler.domains:
                return
            del _handlers[self._ctx_addr]
        handler.stop()


def guard_server(sock: zmq.Socket, name: str, counters: dict, curve: bool = False,
                 curve_allowed: tuple[bytes, ...] = ()) -> Guard:
    """Before ``sock`` binds: PLAIN server with the run's secret (or CURVE when ``curve``; then
    only ``curve_allowed`` keys when given), checked by its context's ZAP handler."""
    if not curve:
        sock.plain_server = True
        run_secret()
    from opentinker.bus.common import plain_context  # common imports this module

    domain = f"{name}/{next(_ids)}"
    sock.zap_domain = domain.encode()
    addr = sock.context.underlying
    with _lock:
        handler = _handlers.get(addr)
        if handler is None:
            handler = _handlers[addr] = _Handler(plain_context(sock.context))
            handler.start()
        handler.domains[domain] = _Domain(counters, name, frozenset(curve_allowed) if curve_allowed else None)
    return Guard(addr, domain)


def release_context(ctx: zmq.Context) -> None:
    """Stop the ZAP handler of ``ctx``, if any, whatever still uses it: call before destroying
    the context (its handler's sockets would otherwise keep the context's termination waiting)."""
    with _lock:
        handler = _handlers.pop(ctx.underlying, None)
    if handler is not None:
        handler.stop()


def handlers_running() -> int:
    """ZAP handler threads alive in this process (tests)."""
    return len(_handlers)
