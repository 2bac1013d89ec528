"""Ctrl-C on a run: the first stops it after the step in progress, with a checkpoint; the
second stops it at once (the newest checkpoint stands; a run with none is removed). SIGTERM
(``kill``, a batch scheduler's preemption) stops it at once, as a second Ctrl-C does, so the
run's components and Ray are shut down on the way out instead of left running."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any


class Interrupted(Exception):
    """A run stopped by Ctrl-C. ``step``: the step of the checkpoint it can resume from (None:
    none); ``removed``: its folder was removed (it had no checkpoint)."""

    def __init__(self, run_dir: Path, step: int | None, removed: bool = False) -> None:
        super().__init__(f"stopped at step {step}" if step is not None else "stopped")
        self.run_dir, self.step, self.removed = Path(run_dir), step, removed

    def line(self) -> str:
        """What to tell the user, in one line."""
        if self.removed:
            return f"stopped before the first training step had a checkpoint: removed {self.run_dir}"
        if self.step is None:
            return f"stopped; {self.run_dir} has no checkpoint to continue from"
        return (f"stopped with the checkpoint of step {self.step}: continue with "
                f"opentinker run --resume {self.run_dir}")


class StopOnInterrupt:
    """Inside (on the main thread), the first SIGINT sets :attr:`asked` and calls ``said`` with
    a message; the next one raises ``KeyboardInterrupt`` as usual; SIGTERM raises it at once.
    Elsewhere it does nothing. ``keeps`` says what the stop keeps (an offline job keeps its
    adapter, not a checkpoint)."""

    def __init__(self, said: Callable[[str], None], keeps: str = "with a checkpoint") -> None:
        self.asked = False
        self._keeps = keeps
        self._said = said
        self._before: Any = None
        self._before_term: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.asked = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
        self._said(f"stopping after this step, {self._keeps} (Ctrl-C again to stop at once)")

    def _terminate(self, signum: int, frame: FrameType | None) -> None:
        self.asked = True
        self._said("terminated: stopping at once")
        raise KeyboardInterrupt  # the path of a second Ctrl-C: components shut down, newest checkpoint stands

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGINT, self._handle)
            self._before_term = signal.signal(signal.SIGTERM, self._terminate)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._before is not None:
            signal.signal(signal.SIGINT, self._before)
            self._before = None
        if self._before_term is not None:
            signal.signal(signal.SIGTERM, self._before_term)
            self._before_term = None
