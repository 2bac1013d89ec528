"""Learner: one per trainable policy. Receives that policy's trajectories on its own PULL
socket, and on a :class:`LearnerStep` turns the step's trajectories into datums (in
episode-id order, never arrival order) with the configured advantage estimator, and asks the
scheduler for ``forward_backward`` and ``optim_step``. The algorithm itself lives in
``learners`` as pure functions; this actor owns the I/O and the estimator's state (the
moving-average baselines of ``reinforce_ema`` and ``role_ema``), which it reports in its
metrics and checkpoints with :meth:`Learner.state_dict` / :meth:`Learner.load_state_dict`.

With a critic estimator (``gae``) a step is PPO with a learned value function: ask the
scheduler for the critic's values of the step's sequences (``ValuesRequest``, before any
update, so they are the "old" values), read each turn's value at its decision position,
compute GAE advantages and lambda-return targets, and send a ``ForwardBackward`` whose
datums carry both the policy's and the value loss's inputs (``loss_config`` holds the
``value`` coefficient; the value term is a mean over turns via ``value_normalizer``).

A step makes ``epochs`` passes over its datums in ``minibatches`` shuffled parts, one update
per part (PPO's K epochs of minibatch SGD; the default, 1 and 1, is one update per step).
Advantages, value targets and the old values stay those computed before the first update;
the importance ratio is always against the sampler's log-probs, so later passes clip.

A learner whose process dies is started again in its step (``restore=True``): as every step
begins (before any update) and as it ends, a learner writes to ``state_path`` its estimator's
state, its last trained step, the adapter version they go with (read with
:class:`DiscardGradients`, which also clears gradients nobody applied) and the last step's
result. The restarted one discards the gradients its predecessor left, reads that file back,
drops from its trajectory log what the step in progress had logged, and checks the adapter is
still at that version, so the step can be made again from the same weights; if the step had
already updated it, starting fails and the job restores its newest checkpoint instead. A step
asked again after it trained is answered with its result, never trained twice.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from learners import (
    ADVANTAGES,
    LOSSES,
    EmaState,
    LossKind,
    assemble,
    loss_token_count,
    losses_of_kind,
    sort_trajectories,
    trajectory_tokens,
)
from opentinker.bus import LOOPBACK, Client, LoopThread, Puller, Server
from opentinker.bus.auth import Credentials
from opentinker.bus.chunking import request_split_async
from opentinker.config import JobConfig
from opentinker.files import write_atomic
from opentinker.training import trajectory_log
from protocols.messages import (
    AdamParams,
    AdapterInfo,
    DiscardGradients,
    ForwardBackward,
    ForwardBackwardResult,
    LearnerStep,
    LearnerStepResult,
    Message,
    OptimStep,
    OptimStepResult,
    TrajectoriesHeld,
    Trajectory,
    TrajectoryAck,
    ValuesRequest,
    ValuesResult,
)

log = logging.getLogger(__name__)


def check_algorithms(advantage: str, loss: str, where: str = "train") -> None:
    """Raise ``ValueError`` naming an advantage estimator or policy loss a job cannot use, with
    the names it can (``where`` names the config table, e.g. ``policies[b].train``)."""
    if advantage not in ADVANTAGES:
        raise ValueError(f"{where}.advantage {advantage!r} is not an advantage estimator; "
                         f"known: {sorted(ADVANTAGES)}")
    policy_losses = losses_of_kind(LossKind.POLICY)
    if loss not in LOSSES or LOSSES[loss].kind is not LossKind.POLICY:
        hint = f" ({loss} is a {LOSSES[loss].kind.value} loss)" if loss in LOSSES else ""
        raise ValueError(f"{where}.loss {loss!r} is not a policy loss{hint}; known: {policy_losses}")


def check_job(cfg: JobConfig) -> None:
    """:func:`check_algorithms` for every policy of a job (with its overrides), before any
    actor starts."""
    for p in cfg.policies:
        tc = cfg.train_for(p.name)
        check_algorithms(tc.advantage, tc.loss, f"policies[{p.name}].train" if p.train else "train")


class Learner:
    """Trains adapter ``policy`` on the scheduler."""

    def __init__(
        self,
        policy: str,
        scheduler_endpoint: str,
        advantage: str,
        loss: str,
        loss_config: Mapping[str, float],
        adam: AdamParams,
        advantage_config: Mapping[str, float] | None = None,
        game: str = "",
        record_path: str = "",
        endpoint: str = LOOPBACK,
        epochs: int = 1,
        minibatches: int = 1,
        seed: int = 0,
        frozen: bool = False,
        scheduler_auth: tuple[str, str] | None = None,
        state_path: str = "",
        restore: bool = False,
        lr_decay_steps: int = 0,
        move_values_against: Mapping[str, float] | None = None,
    ) -> None:
        check_algorithms(advantage, loss)
        if epochs < 1 or minibatches < 1:
            raise ValueError(f"learner {policy}: epochs and minibatches must be >= 1, got {epochs}, {minibatches}")
        self.epochs, self.minibatches, self.seed = epochs, minibatches, seed
        self.frozen = frozen
        """Record and report each step, never update the adapter (``PolicyConfig.frozen``)."""
        self.version = 0
        """The adapter's version after this learner's last update (what a frozen one reports)."""
        self.policy = policy
        self.game = game
        """Prefix of ``role_ema``'s role keys (``"<game>/<seat>"``)."""
        self.record_path = record_path
        """Where each trained step's trajectories are appended (``""``: nowhere)."""
        self.advantage_state: EmaState | None = None
        """The estimator's state, owned here (DESIGN §5); ``None`` until the first step."""
        self.steps_trained = 0
        self.scheduler_endpoint = scheduler_endpoint
        self.scheduler_auth = scheduler_auth
        """``(user, secret)`` it presents to the scheduler (a job's, on a shared scheduler)."""
        self.advantage = advantage
        self.advantage_config = dict(advantage_config or {})
        self.loss = loss
        self.loss_config = dict(loss_config)
        self.adam = adam
        self.move_values_against = dict(move_values_against or {})
        """The ``move_values`` term's weights of each opponent's move values (``{}``: the episode's own)."""
        self.lr_decay_steps = lr_decay_steps
        """> 0: step ``s`` trains at ``adam.lr * (1 - (s - 1) / lr_decay_steps)`` (floored at 0)."""
        self._bind = endpoint
        self._by_step: dict[int, dict[tuple[int, str], Trajectory]] = collections.defaultdict(dict)
        self.duplicates = 0
        """Trajectories that arrived twice (a resend of one already here, or of a trained step)."""
        self.last_step = 0
        """The newest step trained on: later copies of its trajectories are dropped."""
        self._done: tuple[int, list[tuple[int, str]], LearnerStepResult] | None = None
        """The last step trained: its number, the (episode, seat) keys it trained on, its result."""
        self.endpoint = self.pull_endpoint = ""
        self.state_path = state_path
        """Where its state is written as each step begins and ends (``""``: nowhere; no successor
        can take over)."""
        self.restore = restore
        """Started again after a dead process: :meth:`_restore` before serving."""
        if restore and not state_path:
            raise ValueError(f"learner {policy}: restore=True needs the state_path its predecessor wrote")

    def start(self) -> tuple[str, str]:
        """Returns ``(request endpoint, trajectory PULL endpoint)``."""
        self.loop = LoopThread(f"learner-{self.policy}-bus")
        self.endpoint, self.pull_endpoint = self.loop.run(self._start())
        return self.endpoint, self.pull_endpoint

    async def _start(self) -> tuple[str, str]:
        self._arrived = asyncio.Condition()
        self.scheduler = Client(self.loop.ctx, self.scheduler_endpoint, name=f"learner-{self.policy}",
                                credentials=Credentials.of(self.scheduler_auth))
        self.puller = Puller(self.loop.ctx)
        self.server = Server(self._handle, self._bind, name=f"learner-{self.policy}")
        if self.restore:
            await self._restore()
        else:  # a file a former run left in this folder says nothing of this learner
            self._write_live(None, self.last_step)
        self._recv_task = asyncio.create_task(self._receive())
        return await self.server.start(self.loop.ctx), self.puller.endpoint

    async def _discard(self) -> int | None:
        """Clear the adapter's unapplied gradients; its version (``None`` for a frozen policy,
        which never trains)."""
        if self.frozen:
            return None
        reply = await self.scheduler.request(DiscardGradients(adapter=self.policy))
        assert isinstance(reply, AdapterInfo)
        return reply.version

    def _write_live(self, version: int | None, last_step: int, cut_after: int | None = None) -> None:
        """Write (atomically), for a successor (:meth:`_restore`), this learner's state, the last
        step it trained, the adapter ``version`` that state goes with (``None``: not read;
        nothing is checked), the step after which its trajectory log holds nothing trained
        (``cut_after``; ``None``: cut nothing), and the last trained step's result."""
        if not self.state_path:
            return
        path = Path(self.state_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        done = None if self._done is None else {"step": self._done[0], "held": self._done[1],
                                                "result": msgspec.to_builtins(self._done[2])}
        write_atomic(path, json.dumps({"version": version, "last_step": last_step, "cut_after": cut_after,
                                       "learner": self.state_dict(), "done": done}))

    async def _restore(self) -> None:
        """Take over from a learner whose process died: its state as written last (a step's
        start or end), the records of the step in progress dropped from its trajectory log, the
        adapter's unapplied gradients discarded; ``RuntimeError`` when the adapter is no longer
        at the version that state goes with (the step it died in had updated it)."""
        path = Path(self.state_path)
        version = await self._discard()
        if not path.exists():  # it died before its first step began: nothing of it to take over
            return
        try:
            live = json.loads(path.read_text())
            self.load_state_dict(live["learner"])
            self.last_step, began, cut_after = int(live["last_step"]), live["version"], live["cut_after"]
            if live["done"] is not None:
                d = live["done"]
                self._done = (int(d["step"]), [(int(e), str(seat)) for e, seat in d["held"]],
                              msgspec.convert(d["result"], LearnerStepResult))
        except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as e:
            raise RuntimeError(f"learner {self.policy}: cannot restore from {path}: {e}") from e
        if began is not None and version != began:
            raise RuntimeError(f"learner {self.policy}: adapter at version {version}, its state after step "
                               f"{self.last_step} goes with version {began}: the step it died in had updated it, "
                               "so it cannot be made again from the same weights")
        self.version = int(began) if began is not None else self.version
        if cut_after is not None and self.record_path and Path(self.record_path).exists():
            dropped = trajectory_log.truncate(self.record_path, int(cut_after))
            if dropped:
                log.warning("learner %s: dropped %d trajectory records of steps after %d from %s", self.policy,
                            dropped, cut_after, self.record_path)

    def counters(self) -> dict[str, int]:
        out = dict(self.server.counters)
        out.update({f"pull/{k}": v for k, v in self.puller.counters.items()})
        out.update({f"client/{k}": v for k, v in self.scheduler.counters.items()})
        return out

    async def _close_puller(self) -> None:
        """On the loop: the puller's watch and socket are the loop's (uvloop is not thread-safe)."""
        task = getattr(self, "_recv_task", None)
        if task is not None:
            task.cancel()
        self.puller.close()

    async def _receive(self) -> None:
        while True:
            msg = await self.puller.recv()
            if not isinstance(msg, Trajectory) or msg.policy != self.policy:
                log.warning("learner %s: dropped %s", self.policy, type(msg).__name__)
                continue
            key = (msg.episode_id, msg.seat)
            async with self._arrived:
                # A copy of a step already trained on, or a re-sent one already here: kept once.
                if msg.step <= self.last_step or key in self._by_step[msg.step]:
                    self.duplicates += 1
                    continue
                self._by_step[msg.step][key] = msg
                self._arrived.notify_all()

    async def _arrival(self, step: int, expected: int, timeout_s: float) -> bool:
        """Wait (holding ``_arrived``) until ``expected`` trajectories of ``step`` are here or
        ``timeout_s`` passed; whether they are."""
        try:
            await asyncio.wait_for(self._arrived.wait_for(lambda: len(self._by_step[step]) >= expected), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _held(self, msg: TrajectoryAck) -> TrajectoriesHeld:
        """The keys of ``msg.step``'s trajectories held, once ``expected`` are or ``wait_s`` passed
        (a step already trained: those it trained on, so a step played again for another
        learner's sake is acknowledged at once)."""
        if self._done is not None and msg.step == self._done[0]:
            return TrajectoriesHeld(step=msg.step, held=self._done[1], duplicates=self.duplicates)
        async with self._arrived:
            await self._arrival(msg.step, msg.expected, msg.wait_s)
            return TrajectoriesHeld(step=msg.step, held=sorted(self._by_step[msg.step]), duplicates=self.duplicates)

    async def _handle(self, msg: Message) -> Message:
        if isinstance(msg, TrajectoryAck):
            return await self._held(msg)
        if not isinstance(msg, LearnerStep):
            raise TypeError(f"a learner does not serve {type(msg).__name__}")
        if self._done is not None and msg.step == self._done[0]:
            # Trained already (the step is played again because another learner died, or this
            # one died before its reply): the same result, nothing trained twice.
            return self._done[2]
        version_before = await self._discard()  # before anything is taken: a failure here loses nothing
        async with self._arrived:
            if not await self._arrival(msg.step, msg.expected, msg.timeout_s):
                got = len(self._by_step[msg.step])
                raise TimeoutError(f"learner {self.policy}: step {msg.step} has {got} of {msg.expected} trajectories")
            trajectories = sort_trajectories(list(self._by_step.pop(msg.step).values()))
            before = self.last_step
            self.last_step = max(self.last_step, msg.step)
        # Before anything moves: a successor starts from here, and drops what this step logged.
        self._write_live(version_before, before, cut_after=msg.step - 1)
        values = await self._values(trajectories)
        datums, metrics, new_state = assemble(
            trajectories, self.advantage, self.advantage_config, self.advantage_state, self.game, values,
            moves=self.loss_config.get("move_values", 0.0) > 0, move_values_against=self.move_values_against,
        )
        if msg.datums:
            datums = list(msg.datums) if msg.datums_only else [*datums, *msg.datums]
            metrics["all_actions_datums"] = float(len(msg.datums))
        t0 = time.perf_counter()
        if not self.frozen:
            self.version, updates = await self._update(msg.step, datums, values is not None)
            metrics.update(updates)
        version = self.version
        metrics["learn_s"] = time.perf_counter() - t0
        metrics["lr"] = self.adam_at(msg.step).lr
        metrics["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        invalid = sum(t.parse.value == "invalid" for tr in trajectories for t in tr.turns)
        turns = sum(len(tr.turns) for tr in trajectories)
        metrics["invalid_rate"] = invalid / max(turns, 1)
        metrics["turns"] = float(turns)
        # The state moves on only once the step has trained (a failed step leaves it as it was).
        self.advantage_state = new_state
        self.steps_trained += 1
        if self.record_path:
            trajectory_log.append(self.record_path, trajectories, self.game)
        if new_state is not None:
            metrics.update({f"baseline/{k}": v for k, v in new_state.baselines.items()})
        result = LearnerStepResult(step=msg.step, version=version, metrics=metrics)
        self._done = (msg.step, sorted((t.episode_id, t.seat) for t in trajectories), result)
        self._write_live(None if self.frozen else version, msg.step, cut_after=msg.step)  # a successor starts after it
        return result

    def adam_at(self, step: int) -> AdamParams:
        """The optimizer's settings at ``step`` (the learning rate on its schedule)."""
        if not self.lr_decay_steps:
            return self.adam
        return msgspec.structs.replace(self.adam, lr=self.adam.lr * max(0.0, 1.0 - (step - 1) / self.lr_decay_steps))

    async def _update(self, step: int, datums: list, critic: bool) -> tuple[int, dict[str, float]]:
        """``epochs`` passes over ``datums``, each shuffled (seeded by the job's seed, the step
        and the pass) and split into ``minibatches`` parts, one ``ForwardBackward`` +
        ``OptimStep`` per part, each part normalised by its own token count (a part larger than
        one message goes in slices with the part's normalizers, :mod:`opentinker.bus.chunking`;
        their results merged are the part's). Returns the
        adapter's version after the last update and the metrics: each loss metric's mean over
        the updates (``*_max``: the largest; token counts: per pass), ``grad_norm``'s mean, the
        number of updates. With one update they are that update's exact metrics."""
        passes = self.epochs if datums else 1  # no datums: one (empty) update, as ever
        parts: list[list] = []
        for epoch in range(passes):
            if self.minibatches == 1 or not datums:
                parts.append(datums)
                continue
            order = np.random.default_rng([self.seed & 0xFFFFFFFF, step, epoch]).permutation(len(datums))
            parts += [[datums[i] for i in chunk] for chunk in np.array_split(order, self.minibatches) if len(chunk)]
        sums: dict[str, float] = collections.defaultdict(float)
        peaks: dict[str, float] = {}
        version = -1
        for part in parts:
            n_tokens = loss_token_count(part)
            n_values = loss_token_count(part, "value_mask") if critic and part else 0
            # In slices the scheduler takes, each with the part's normalizers: one update's gradient.
            fb = await request_split_async(self.scheduler.request, ForwardBackward(
                adapter=self.policy, datums=part, loss=self.loss, loss_config=self.loss_config,
                normalizer=float(max(n_tokens, 1)), value_normalizer=float(max(n_values, 1)),
            ))
            assert isinstance(fb, ForwardBackwardResult)
            opt = await self.scheduler.request(OptimStep(adapter=self.policy, params=self.adam_at(step)))
            assert isinstance(opt, OptimStepResult)
            version = opt.version
            for k, v in fb.metrics.items():
                sums[f"loss/{k}"] += v
                if k.endswith("_max"):
                    peaks[f"loss/{k}"] = max(v, peaks.get(f"loss/{k}", v))
            sums["loss"] += fb.loss
            sums["grad_norm"] += opt.grad_norm
        n = len(parts)
        out = {k: v / (passes if k.endswith("n_tokens") else n) for k, v in sums.items()}
        out.update(peaks)
        out["updates"] = float(n)
        return version, out

    async def _values(self, ordered: list[Trajectory]) -> list[np.ndarray] | None:
        """The critic's values along each trajectory's sequence, for an estimator that needs
        them (else ``None``); taken before this step's update, so they are the old values."""
        if not ADVANTAGES[self.advantage].needs_values or not ordered:
            return None
        reply = await request_split_async(
            self.scheduler.request, ValuesRequest(adapter=self.policy, sequences=[trajectory_tokens(t) for t in ordered]))
        assert isinstance(reply, ValuesResult)
        return reply.values

    def state_dict(self) -> dict[str, Any]:
        """What this learner carries from step to step, as plain JSON-able data."""
        state = self.advantage_state
        return {
            "policy": self.policy,
            "advantage": self.advantage,
            "advantage_state": None if state is None else state.to_json(),
            "steps_trained": self.steps_trained,
        }

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` when it is malformed or was
        written by another estimator (its baselines would mean something else)."""
        if not isinstance(data, Mapping) or not {"advantage", "advantage_state", "steps_trained"} <= set(data):
            raise ValueError(f"learner {self.policy}: not a learner state: {data!r}")
        if data["advantage_state"] is not None and data["advantage"] != self.advantage:
            raise ValueError(f"learner {self.policy}: state written by advantage {data['advantage']!r}, "
                             f"this learner uses {self.advantage!r}")
        raw = data["advantage_state"]
        self.advantage_state = None if raw is None else EmaState.from_json(raw)
        self.steps_trained = int(data["steps_trained"])
        if not self.restore:  # a resumed run's state: what a successor takes over until a step begins
            self._write_live(None, self.last_step)

    def stop(self) -> None:
        if hasattr(self, "loop"):
            self.loop.run(self.server.stop())
            self.loop.run(self._close_puller())
            self.scheduler.close()
            self.loop.stop()
