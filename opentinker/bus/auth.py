"""Who may talk on the bus: every socket authenticates its peers, loopback included.

* **PLAIN with the run's secret** (the default, every socket): a server accepts a connection
  only when the peer presents this process's bus user (``opentinker`` unless
  ``$OPENTINKER_BUS_USER`` names another) and this run's secret, or one of the server's
  ``accounts`` (a shared scheduler's jobs, each a user with its own secret); the check
  is ZeroMQ's ZAP handshake, so an unauthenticated process never gets a frame of its own
  decoded (libzmq drops the connection before any message is passed up). PLAIN sends the
  secret in clear text, which is why it is for loopback (and ``ipc://``) only.
* **CURVE** (``keys=CurveKeys``, required to bind a non-loopback address): authentication and
  encryption; a server with ``allowed_clients`` accepts only those public keys.
* **The run's CURVE pair** (:func:`set_run_curve`, a job that spans machines or forces CURVE
  with ``runtime.curve``): every socket of the process made from then on without keys or
  credentials of its own uses it, a server as a CURVE server that accepts only the run's
  public key, a client presenting the pair, and servers bind the given host (the node's
  address) instead of 127.0.0.1. The runtime makes one pair per run and hands it to every
  actor with its other arguments; it is never written to a file, a log or the environment.

The run's secret is made once per process (``secrets.token_urlsafe(32)``) unless the
environment names one in ``OPENTINKER_BUS_SECRET``; it is put in this process's environment,
so processes started from it (Ray's raylet and its workers when this process starts Ray, a
benchmark's server processes) inherit it, and the runtime hands it to every actor it starts
(:mod:`opentinker.control.runtime`). A process's environment is readable only by its user
(``/proc/<pid>/environ`` is mode 0400); the secret is never written to a file or a log.

The user a peer authenticated as is its *principal*: ZeroMQ stamps it on every message of the
connection (the ``User-Id`` property), and :class:`~opentinker.bus.server.Server` keeps it with
the peer's session, so a shared scheduler knows which job sent a request without trusting
anything the peer says. A CURVE peer's principal is this process's user (the allow lists hold
the run's own keys).

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
import re
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from opentinker.bus.frames import plain_context
from opentinker.bus.logs import LogEvery

log = logging.getLogger(__name__)

SECRET_ENV = "OPENTINKER_BUS_SECRET"
USER_ENV = "OPENTINKER_BUS_USER"
USERNAME = "opentinker"
"""The bus user of a process whose environment names none."""
MIN_SECRET_CHARS = 32
MAX_SECRET_CHARS = 255
"""ZeroMQ's PLAIN carries at most 255 bytes of password."""

_secret: bytes | None = None
_user: str | None = None
_curve: tuple[bytes, bytes, str] | None = None
"""The run's CURVE public key, secret key (Z85) and the host its servers bind, once set."""
_lock = threading.Lock()
_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
"""A bus user name: what a job id is made of (:func:`check_user`)."""


def check_user(value: str, where: str = "bus user") -> str:
    """``value`` if it can be a bus user (1 to 64 of ``A-Z a-z 0-9 _ . + -``, starting with a
    letter or digit), else ``ValueError`` naming ``where``."""
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise ValueError(f"{where}: a bus user is 1 to 64 letters, digits, '_', '.', '+' or '-', starting with a "
                         f"letter or digit (got {value!r:.80})")
    return value


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


def run_user() -> str:
    """This process's bus user: ``$OPENTINKER_BUS_USER``, else ``opentinker``."""
    global _user
    with _lock:
        if _user is None:
            _user = check_user(os.environ.get(USER_ENV) or USERNAME, f"${USER_ENV}")
        return _user


def set_run_secret(value: str) -> None:
    """Use ``value`` as this process's bus secret (an actor, given the driver's): sockets made
    from now on present and accept it."""
    global _secret
    checked = _checked(value, "bus secret")
    with _lock:
        _secret = checked
        os.environ[SECRET_ENV] = value


def set_run_curve(pair: tuple[str, str] | None, host: str = "127.0.0.1") -> None:
    """Use the CURVE key pair ``(public, secret)`` (Z85, 40 characters each) for every socket
    of this process made from now on without keys or credentials of its own, servers binding
    ``host``; ``None``: back to PLAIN with the run's secret on loopback."""
    global _curve
    if pair is None:
        with _lock:
            _curve = None
        return
    public, secret = (k.encode() if isinstance(k, str) else bytes(k) for k in pair)
    for what, key in (("public", public), ("secret", secret)):
        try:
            ok = len(key) == 40 and len(z85.decode(key)) == 32
        except (ValueError, KeyError, IndexError):  # not Z85
            ok = False
        if not ok:
            raise ValueError(f"run CURVE {what} key: 40 Z85 characters expected (got {len(key)} bytes)")
    if not isinstance(host, str) or not host or any(c in host for c in "/*[] \t\n"):
        raise ValueError(f"run CURVE bind host: an IP address or host name expected (got {host!r:.80})")
    with _lock:
        _curve = (public, secret, host)


def run_curve() -> tuple[bytes, bytes, str] | None:
    """The run's CURVE ``(public, secret, bind host)`` when :func:`set_run_curve` set one."""
    return _curve


def new_secret() -> str:
    """A fresh secret for an account (a job on a shared scheduler)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Credentials:
    """A bus user and its secret, for a socket that presents other than this process's own
    (a job's on a shared scheduler, :class:`~protocols.messages.JobOpened`). With ``curve``
    (a service reachable from other machines: ``serve --bus-host``), the socket presents a
    CURVE key pair instead, which the server maps to ``user``: ``(client public, client
    secret, server public)``, Z85 text."""

    user: str
    secret: str
    curve: tuple[str, str, str] | None = None

    def __post_init__(self) -> None:
        check_user(self.user)
        _checked(self.secret, f"secret of bus user {self.user!r}")
        if self.curve is not None and (len(self.curve) != 3 or not all(len(k) == 40 for k in self.curve)):
            raise ValueError(f"CURVE keys of bus user {self.user!r}: three 40-character Z85 keys expected")

    def __repr__(self) -> str:  # never print the secrets
        return f"Credentials(user={self.user!r}, secret=..., curve={'...' if self.curve else None})"

    @classmethod
    def of(cls, pair: tuple[str, ...] | list[str] | None) -> Credentials | None:
        """From :meth:`pair`'s tuple as a component's arguments carry it; None for None."""
        if not pair:
            return None
        return cls(pair[0], pair[1], tuple(pair[2:5]) if len(pair) == 5 else None)  # type: ignore[arg-type]

    def pair(self) -> tuple[str, ...]:
        """``(user, secret)``, or ``(user, secret, client public, client secret, server public)``."""
        return (self.user, self.secret, *(self.curve or ()))


def secure_client(sock: zmq.Socket, credentials: Credentials | None = None) -> None:
    """Make a connecting socket present ``credentials``, else this process's bus user and
    secret (PLAIN)."""
    if credentials is not None:
        sock.plain_username, sock.plain_password = credentials.user.encode(), credentials.secret.encode()
        return
    sock.plain_username = run_user().encode()
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
    accounts: Mapping[str, bytes] | None = None
    """Further PLAIN users this server accepts, user -> secret (a shared scheduler's jobs;
    read at each handshake, so an account added or removed takes effect at the next one)."""
    curve_users: Mapping[str, str] | None = None
    """On a CURVE server: the only client keys it accepts, public key (Z85 text) -> the user it
    stands for (a shared scheduler's owner and jobs; read at each handshake)."""


class _Handler(ThreadAuthenticator):
    """One ZAP handler per context: PLAIN against the run's secret, CURVE against each
    domain's allowed keys; refusals counted per domain."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.domains: dict[str, _Domain] = {}
        self._log = LogEvery(log)
        self._domain = ""
        """The domain of the request being answered (one at a time, in the handler's thread)."""

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        d = self.domains.get(domain)
        ok = False
        if d is not None:
            expected = run_secret() if username == run_user() else (d.accounts or {}).get(username)
            # Compared in constant time whoever the user is (an unknown one against a dummy).
            ok = hmac.compare_digest(password.encode(), expected or b"\0" * MIN_SECRET_CHARS) and expected is not None
        return ok, b"OK" if ok else b"wrong credentials"

    def curve_user_id(self, client_public_key: bytes) -> str:
        d = self.domains.get(self._domain)
        users = d.curve_users if d is not None else None
        return users.get(z85.encode(client_public_key).decode(), run_user()) if users is not None else run_user()

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        d = self.domains.get(domain)
        key = z85.encode(client_key)
        if d is not None and d.curve_users is not None:
            ok = key.decode() in d.curve_users
        else:
            ok = d is not None and (d.curve_allowed is None or key in d.curve_allowed)
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
                 curve_allowed: tuple[bytes, ...] = (), accounts: Mapping[str, bytes] | None = None,
                 curve_users: Mapping[str, str] | None = None) -> Guard:
    """Before ``sock`` binds: PLAIN server with the run's user and secret, and the users of
    ``accounts`` with theirs (or CURVE when ``curve``; then only the keys of ``curve_users``,
    each as its user, when given, else only ``curve_allowed`` keys when given), checked by its
    context's ZAP handler."""
    if not curve:
        sock.plain_server = True
        run_secret()
    domain = f"{name}/{next(_ids)}"
    sock.zap_domain = domain.encode()
    addr = sock.context.underlying
    with _lock:
        handler = _handlers.get(addr)
        if handler is None:
            handler = _handlers[addr] = _Handler(plain_context(sock.context))
            handler.start()
        handler.domains[domain] = _Domain(counters, name, frozenset(curve_allowed) if curve_allowed else None,
                                          accounts, curve_users)
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
