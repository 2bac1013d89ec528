"""Every trajectory of a training step reaches its learner before the learner trains: the
learners acknowledge what they hold and the runners push what is missing again
(:func:`deliver`; ``docs/reliability.md``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from opentinker.bus import Client
from protocols.messages import (
    EpisodeSpec,
    EpisodeSummary,
    PolicyKind,
    ResendTrajectories,
    TrajectoriesHeld,
    TrajectoryAck,
)

log = logging.getLogger(__name__)


async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather`` that, when one fails, cancels the others (a request cancelled on a
    client sends ``Cancel``) and waits for them before raising: a step that failed (a dead
    runner) leaves no episodes playing behind the step played again."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

DELIVERY_WAIT_S = 3.0
"""How long a learner waits for a step's trajectories before saying which it holds (they were
all pushed before the runners answered, so only a lost one takes this long; a copy re-sent
too early is dropped by the learner)."""
RESEND_WAIT_S = 2.0
"""The same wait after a resend."""
DELIVERY_ROUNDS = 5
"""Resends of missing trajectories before the step fails."""


async def deliver(step: int, specs: list[EpisodeSpec], by_id: dict[int, EpisodeSummary], runners: list[Client],
                  learners: dict[str, Client], timeout_s: float) -> dict[str, float]:
    """Make sure every learner holds every trajectory of the step before it trains: each
    learner acknowledges what it holds (:class:`TrajectoryAck`, once all have arrived or
    :data:`DELIVERY_WAIT_S` passed), and the runner that played a missing one pushes it
    again (:class:`ResendTrajectories`), up to :data:`DELIVERY_ROUNDS` times; a copy that
    arrives twice is dropped by the learner. Returns ``train/<policy>/resent`` and
    ``/duplicates_total`` (copies the learner dropped over the run). ``RuntimeError`` naming the policy when some never arrive.

    Args:
        specs: ``[E]`` the step's episodes, in the order the coordinator split them over
            ``runners`` (episode ``j`` went to ``runners[j % len(runners)]``).
        by_id: episode id -> its summary (which seats took turns).
        runners: the coordinator's clients of the env runners.
        learners: policy -> the coordinator's client of its learner.
        timeout_s: the longest wait for a runner's resend."""
    n = len(runners)
    runner_of = {spec.episode_id: runners[j % n] for j, spec in enumerate(specs)}  # as _run splits
    want: dict[str, set[tuple[int, str]]] = {name: set() for name in learners}
    for spec in specs:
        s = by_id[spec.episode_id]
        for seat, ref in spec.seats.items():
            if ref.kind is PolicyKind.ADAPTER and ref.name in want and s.turns.get(seat, 0) > 0:
                want[ref.name].add((spec.episode_id, seat))
    resent = {name: 0 for name in want}
    duplicates: dict[str, int] = {}
    for attempt in range(DELIVERY_ROUNDS + 1):
        acks = await asyncio.gather(*(
            learners[name].request(TrajectoryAck(step=step, expected=len(keys),
                                                      wait_s=DELIVERY_WAIT_S if attempt == 0 else RESEND_WAIT_S),
                                        DELIVERY_WAIT_S + 30)
            for name, keys in want.items()))
        missing = {}
        for (name, keys), ack in zip(want.items(), acks):
            assert isinstance(ack, TrajectoriesHeld)
            duplicates[name] = ack.duplicates
            lost = keys - {(e, seat) for e, seat in ack.held}
            if lost:
                missing[name] = lost
        if not missing:
            break
        if attempt == DELIVERY_ROUNDS:
            raise RuntimeError(
                f"step {step}: " + "; ".join(f"{len(v)} trajectories of policy {k} never reached its learner"
                                             for k, v in missing.items())
                + f" after {DELIVERY_ROUNDS} resends (is the learner's process alive?)")
        by_runner: dict[int, list[tuple[int, str]]] = {}
        for name, lost in missing.items():
            resent[name] += len(lost)
            for key in sorted(lost):
                by_runner.setdefault(runners.index(runner_of[key[0]]), []).append(key)
        log.warning("step %d: resending %d trajectories that did not reach their learners", step,
                    sum(len(v) for v in by_runner.values()))
        replies = await asyncio.gather(*(runners[i].request(ResendTrajectories(step=step, keys=keys), timeout_s)
                                         for i, keys in by_runner.items()))
        gone = [k for r in replies for k in getattr(r, "missing", [])]
        if gone:  # a runner no longer has them (restarted): resending cannot help
            raise RuntimeError(f"step {step}: {len(gone)} trajectories never reached their learner and their "
                               f"runner no longer holds them (e.g. episode {gone[0][0]}, seat {gone[0][1]})")
    out = {f"train/{name}/resent": float(v) for name, v in resent.items()}
    out.update({f"train/{name}/duplicates_total": float(v) for name, v in duplicates.items()})
    return out
