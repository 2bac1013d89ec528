"""Log records that are always one line: control characters in them are escaped.

Text that a peer, a game, a model or a config chose (peer names, shutdown reasons, bad
frames, exception messages) reaches log lines. Written raw, a newline in it starts a line
that looks like a record of its own, a carriage return overwrites one on a terminal, and an
ESC sequence drives the terminal. :func:`escape_controls` replaces every such character with
a visible escape (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u2028``), and :func:`setup_logging`
puts one handler first on the ``opentinker`` logger that applies it to every record of the
package (message, arguments and traceback together) before any other handler formats it, so
one record is always one line.

The handler is transparent otherwise: the root logger's handlers, where an application (or
pytest) configured some, get the escaped record as before; where there are none, it writes
the record to the current ``sys.stderr`` at WARNING and above, as Python's last-resort handler
does. A handler that someone attaches to a module's own logger (``opentinker.bus.server``)
runs before it and sees the raw record.
"""

from __future__ import annotations

import logging
import re
import sys

__all__ = ["EscapingFormatter", "ProjectHandler", "escape_controls", "make_one_line", "setup_logging"]

_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""C0 controls (NUL to US, with TAB, LF, CR, ESC), DEL, C1 controls (NEL among them) and the
Unicode line and paragraph separators: every character a terminal or a log reader may take
as a line break or a command."""

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1, U+2028, U+2029) replaced by a
    visible escape (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u2028``); other text, backslashes
    included, is unchanged."""
    return _CONTROLS.sub(_escape, text)


class EscapingFormatter(logging.Formatter):
    """A formatter whose output has no control characters: the formatted record (message,
    traceback, stack) is passed through :func:`escape_controls`, so it is one line."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(super().format(record))


def make_one_line(record: logging.LogRecord) -> None:
    """Rewrite ``record`` in place so that every formatter prints it as one line: its message
    becomes the escaped full text (message with its arguments, traceback, stack) and nothing
    is left for a formatter to add lines from (no arguments, exception or stack)."""
    if getattr(record, "_opentinker_one_line", False):
        return
    text = record.getMessage()
    if record.exc_info:
        text += "\n" + logging.Formatter().formatException(record.exc_info)
    elif record.exc_text:
        text += "\n" + record.exc_text
    if record.stack_info:
        text += "\n" + record.stack_info
    record.msg, record.args = escape_controls(text), None
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    record._opentinker_one_line = True


class ProjectHandler(logging.Handler):
    """The ``opentinker`` logger's handler. It comes first on the package's logger, and a
    record is handed to the handlers of its logger's ancestors in order, so rewriting the record
    in place (:func:`make_one_line`) means every handler after it (the root logger's, which an
    application or pytest configures) gets the one-line record. Where no other handler would
    see the record, it writes it to the current ``sys.stderr`` (looked up at each record, so a
    swapped stream is followed) at :data:`FALLBACK_LEVEL` and above, as Python's last-resort
    handler does."""

    FALLBACK_LEVEL = logging.WARNING
    """Python's last-resort handler's level: what an unconfigured program shows."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(EscapingFormatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            make_one_line(record)
            if record.levelno >= self.FALLBACK_LEVEL and not self._others_see(record):
                sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001  (logging must never raise into the caller)
            self.handleError(record)

    def _others_see(self, record: logging.LogRecord) -> bool:
        """Whether a handler other than this one gets ``record`` (as ``Logger.callHandlers``
        walks the hierarchy: up while ``propagate``, levels checked)."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self and record.levelno >= h.level for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


def setup_logging() -> ProjectHandler:
    """Put one :class:`ProjectHandler` first on the ``opentinker`` logger (idempotent; called
    when the package is imported, so every process of a job has it)."""
    logger = logging.getLogger("opentinker")
    for handler in logger.handlers:
        if isinstance(handler, ProjectHandler):
            return handler
    handler = ProjectHandler()
    logger.handlers.insert(0, handler)
    return handler
