"""Log lines a peer cannot multiply: :class:`LogEvery`.

The lowest room of the bus with :mod:`opentinker.bus.frames` (it imports nothing of the bus),
so every module above it, the authenticator included, logs through it.
"""

from __future__ import annotations

import logging
import math
import time


class LogEvery:
    """At most one log line per key every ``interval_s`` (what a peer's frames may write to a
    log is bounded too); events in between are counted and reported with the next line. Every
    line a peer, a client or a job can repeat at will goes through one (an attack had one
    written per dropped reply: 17,997 lines in 3.4 s)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval_s`` ago; True when
        it was logged."""
        return self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object, exc_info: BaseException | None = None) -> bool:
        """As :meth:`warning`, at ERROR, with ``exc_info``'s traceback when it is logged."""
        return self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: BaseException | None = None) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` was logged less than ``interval_s``
        ago; True when it was logged."""
        now = time.monotonic()
        last, skipped = self._last.get(key, (-math.inf, 0))
        if now - last < self.interval_s:
            self._last[key] = (last, skipped + 1)
            return False
        if skipped:
            msg += f" ({skipped} more like it in the last {now - last:.1f} s)"
        if len(self._last) > 4096:  # keys a peer names (its identity) must not grow without bound
            self._last.clear()
        self._last[key] = (now, 0)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True
