"""The driver's end of the episode progress that env runners stream over the bus.

A driver blocks on one coordinator call per training step or evaluation; meanwhile each env
runner pushes a :class:`~protocols.messages.Metrics` (``episodes_done``, ``episodes``,
``train``) to the endpoint named in ``RunEpisodes.progress`` as its episodes end.
:class:`EpisodeFeed` binds that PULL socket on a loop thread of its own and reports the
current batch's totals, summed over the runners, to a callback (e.g. a progress bar).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from opentinker.bus import LoopThread, Puller
from protocols.messages import Metrics

OnChange = Callable[[int, int, bool], None]
"""``on_change(episodes_done, episodes, train)`` for the batch in progress."""


class EpisodeFeed:
    """A PULL socket for the runners' progress; :attr:`endpoint` goes into coordinator calls."""

    def __init__(self, on_change: OnChange) -> None:
        self.on_change = on_change
        self.received = 0
        self._by_source: dict[str, tuple[tuple[int, bool], int, int]] = {}
        self.loop = LoopThread("progress-feed")
        self.endpoint = self.loop.run(self._start())

    async def _start(self) -> str:
        self.puller = Puller(self.loop.ctx)
        self._task = asyncio.create_task(self._read())
        return self.puller.endpoint

    async def _read(self) -> None:
        while True:
            msg = await self.puller.recv()
            if not isinstance(msg, Metrics) or "episodes_done" not in msg.values:
                continue
            self.received += 1
            key = (msg.step, bool(msg.values.get("train", 0.0)))
            self._by_source[msg.source] = (key, int(msg.values["episodes_done"]), int(msg.values.get("episodes", 0)))
            current = [(d, n) for k, d, n in self._by_source.values() if k == key]
            self.on_change(sum(d for d, _ in current), sum(n for _, n in current), key[1])

    def close(self) -> None:
        self.loop.run(self._close())
        self.loop.stop()

    async def _close(self) -> None:
        self._task.cancel()
        self.puller.close()
