"""Coordinator: the job's brain. Derives every episode (id, group, seats, seed) from the root
seed, hands episodes to env runners, tells each learner when a step is complete, and runs the
evaluations. It talks to every other component over the bus only; a driver calls it once
per training step or evaluation, so the number of driver calls per step does not grow with
the number of episodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from typing import Any

import msgspec
import numpy as np

import games
from games.evaluation import Distribution, ExactMeasure
from games.scripted import SCRIPTED
from opentinker.bus import Client, LoopThread
from opentinker.bus.auth import Credentials
from opentinker.bus.chunking import request_split_async
from opentinker.config import JobConfig, league_pool
from opentinker.control.all_actions import Scored, all_actions_terms
from opentinker.control.checkpoints import LEAGUE_STATE
from opentinker.control.delivery import deliver, gather_or_cancel
from opentinker.control import transcripts
from opentinker.control.perf import engine_metrics
from opentinker.eval.evaluation import (
    BARE,
    SPELLINGS,
    game_result,
    pairing_metrics,
    policy_from_logprobs,
    policy_sequences,
)
from opentinker.eval.ratings import RunningRatings, rating_metrics
from opentinker.rollout.env_runner import runner_share
from opentinker.rollout.episodes import game_agents, strata_episodes, train_episodes
from opentinker.rollout.matchmaking import WinRates
from opentinker.rollout.render import ChatTokenizer
from opentinker.rollout.routes import Routes
from protocols.messages import (
    MAX_STATS_BATCHES,
    CreateAdapter,
    DropAdapter,
    EpisodesDone,
    EpisodeSpec,
    EpisodeSummary,
    LearnerStep,
    LearnerStepResult,
    LoadAdapter,
    LogprobsRequest,
    LogprobsResult,
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SamplingParams,
    SaveAdapter,
    SchedulerStats,
    SnapshotAdapter,
)

log = logging.getLogger(__name__)

EVAL_STEP_BASE = 1 << 40  # episode ids of evaluations live far above training ids
RATING_ANCHOR = "random"
"""The player every rating is relative to (it plays every game)."""


class Coordinator:
    def __init__(
        self,
        cfg: JobConfig,
        model_path: str,
        scheduler_endpoint: str,
        runner_endpoints: list[str],
        learner_endpoints: dict[str, tuple[str, str]],
        scheduler_auth: tuple[str, str] | None = None,
        routes: dict[str, str] | None = None,
        transcripts_path: str = "",
    ) -> None:
        games.resolve(cfg.game)  # ValueError naming an unknown game
        game_agents(cfg.game, cfg.game_kwargs)  # ValueError naming a bad game_kwargs
        self.game_eval = games.evaluation(cfg.game)
        # (opponent names were checked when the config was read: JobConfig.__post_init__)
        self.cfg = cfg
        self.model_path = model_path
        self.scheduler_endpoint = scheduler_endpoint
        self.routes = Routes(scheduler_endpoint, routes)
        """Policy -> its scheduler's endpoint (``runtime.devices``); the rest: ``scheduler_endpoint``."""
        self.scheduler_auth = scheduler_auth
        """``(user, secret)`` it presents to the scheduler (a job's, on a shared scheduler)."""
        self.runner_endpoints = list(runner_endpoints)
        self.learner_endpoints = dict(learner_endpoints)
        self.sampling = SamplingParams(
            temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k, max_tokens=cfg.sampling.max_tokens,
        )
        self.transcripts: list[str] = []
        self.transcripts_path = transcripts_path
        """Where each training step's first episodes are appended as text (``""``: nowhere)."""
        self.league: dict[str, list[str]] = {p.name: [] for p in cfg.policies}
        """Policy -> its league snapshots on the scheduler, oldest first."""
        self._fresh_league()
        self._scored: dict[tuple[str, tuple[str, ...]], tuple[Any, list[np.ndarray], list[int]]] = {}
        """(measure, spellings) -> the measure's decisions, their token sequences, reply lengths."""
        self._step_scores: dict[tuple[str, str], Scored] = {}
        """(policy, measure) -> its bare canonical replies scored at this training step's start
        (a league snapshot's are kept while it is in the league: its weights never change)."""
        self.untrained = not any(p.init for p in cfg.policies)
        """Every policy is still a fresh adapter (LoRA B = 0): each one *is* the base model, so
        a game between two of them, or against the base model, is a mirror match."""

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.tok = ChatTokenizer(self.model_path)
        self.loop = LoopThread("coordinator-bus")
        self.loop.run(self._connect())

    async def _connect(self) -> None:
        ctx = self.loop.ctx
        self.schedulers = {ep: Client(ctx, ep, name="coordinator", credentials=Credentials.of(self.scheduler_auth))
                           for ep in self.routes.endpoints()}
        self.runners = [Client(ctx, ep, name=f"coordinator->runner{i}") for i, ep in enumerate(self.runner_endpoints)]
        self.learners = {p: Client(ctx, ep, name=f"coordinator->{p}") for p, (ep, _) in self.learner_endpoints.items()}
        for p in self.cfg.policies:
            if p.init:  # a warm start: the saved weights, a fresh optimizer (checked: the same spec)
                await self._scheduler(p.name).request(LoadAdapter(path=p.init, name=p.name, fresh=True),
                                                      self.cfg.runtime.timeout_s)
                continue
            spec = self.cfg.lora_spec(p.name)
            await self._scheduler(p.name).request(CreateAdapter(name=p.name, spec=spec), self.cfg.runtime.timeout_s)

    def _scheduler(self, adapter: str | None) -> Client:
        """The client of the scheduler that holds ``adapter`` (its policy's)."""
        return self.schedulers[self.routes(adapter)]

    async def _stats(self, reset_peak: bool = False) -> SchedulerStats:
        """The job's schedulers' statistics: counters summed (memory: the largest scheduler's),
        batches one after the other. ``reset_peak``: each scheduler's peak-memory mark starts
        again after this reading."""
        parts = await asyncio.gather(*(c.request(SchedulerStats(reset_peak=reset_peak))
                                       for c in self.schedulers.values()))
        if len(parts) == 1:
            return parts[0]
        counters: dict[str, int] = {}
        for part in parts:
            for k, v in part.counters.items():
                counters[k] = max(counters.get(k, 0), v) if k.startswith("mem/") else counters.get(k, 0) + v
        return msgspec.structs.replace(parts[0], counters=counters, batches=[b for p in parts for b in p.batches][-MAX_STATS_BATCHES:])

    def replace_runner(self, index: int, endpoint: str) -> None:
        """Talk to env runner ``index`` at ``endpoint`` from now on (it was started again)."""
        async def swap() -> None:
            self.runners[index].close()
            self.runners[index] = Client(self.loop.ctx, endpoint, name=f"coordinator->runner{index}")
            self.runner_endpoints[index] = endpoint

        self.loop.run(swap())

    def replace_learner(self, policy: str, endpoints: list[str]) -> None:
        """Talk to ``policy``'s learner at ``endpoints`` (request, trajectory PULL) from now on
        (it was started again); runners push to the new PULL endpoint from the next step."""
        async def swap() -> None:
            self.learners[policy].close()
            self.learners[policy] = Client(self.loop.ctx, endpoints[0], name=f"coordinator->{policy}")
            self.learner_endpoints[policy] = (endpoints[0], endpoints[1])

        self.loop.run(swap())

    def stop(self) -> None:
        if hasattr(self, "loop"):
            for c in [*self.schedulers.values(), *self.runners, *self.learners.values()]:
                c.close()
            self.loop.stop()

    # ----------------------------------------------------------------------------- episodes

    async def _run(self, specs: list[EpisodeSpec], step: int, train: bool, progress: str = "") -> list[EpisodeSummary]:
        """Split episodes over the runners (round robin, in id order) and wait for all; the
        runners push their progress to ``progress`` (a PULL endpoint) when it is given,
        counted over the whole call (one ``batch``).

        A training step's part of a runner goes at once. An evaluation's goes in waves of as
        many episodes as the runner plays at once (:func:`runner_share`),
        one wave after the other, so ``runtime.timeout_s`` bounds a wave, not the whole
        evaluation: a job of three policies' final evaluation (1,152 dialogue games) ran past
        900 s as one request per runner. A part (or wave) larger than one message goes as several
        ``RunEpisodes`` of consecutive slices, all at once."""
        n = len(self.runners)
        learners = {p: pull for p, (_, pull) in self.learner_endpoints.items()} if train else {}
        parts = [specs[i::n] for i in range(n)]
        longest = max(map(len, parts), default=0)
        wave = max(1, longest) if train else runner_share(n)
        timeout = self.cfg.runtime.timeout_s
        batch = int.from_bytes(os.urandom(6), "little") | 1  # nonzero: this call, in the runners' progress
        summaries: list[EpisodeSummary] = []
        for start in range(0, longest, wave):
            replies = await gather_or_cancel(
                *(
                    request_split_async(
                        lambda m, r=r: r.request(m, timeout),
                        RunEpisodes(episodes=part[start:start + wave], sampling=self.sampling,
                                    system_prompt=self.cfg.system_prompt, learners=learners, step=step,
                                    progress=progress, explore=self.cfg.sampling.explore if train else 0.0,
                                    group_draws=train and self.cfg.train.opponent_draws == "group",
                                    batch=batch, batch_episodes=len(part)),
                        concurrent=True,
                    )
                    for r, part in zip(self.runners, parts)
                    if part[start:start + wave]
                )
            )
            summaries += [s for rep in replies for s in rep.summaries if isinstance(rep, EpisodesDone)]
        return sorted(summaries, key=lambda s: s.episode_id)

    # ----------------------------------------------------------------------------- training

    def train_step(self, step: int, progress: str = "") -> dict[str, float]:
        """Play the step's episodes, then train every policy on them; returns metrics.
        ``progress``: a PULL endpoint for the runners' :class:`Metrics` as episodes end."""
        return self.loop.run(self._train_step(step, progress))

    async def _train_step(self, step: int, progress: str = "") -> dict[str, float]:
        t0 = time.perf_counter()
        self.untrained = False
        before = (await self._stats(reset_peak=True)).counters  # the step's own memory peak from here
        live = {name for names in self.league.values() for name in names}  # frozen: scored once
        self._step_scores = {k: v for k, v in self._step_scores.items() if k[0] in live}
        tables, exploit = await self._best_responses()
        if tables:
            exploit["timing_s/best_response"] = time.perf_counter() - t0
        extra, more = await self._all_actions(step)
        exploit.update(more)
        specs = train_episodes(self.cfg, step, self.win_rates, tables)
        summaries = await self._run(specs, step, train=True, progress=progress)
        t1 = time.perf_counter()
        after = (await self._stats()).counters
        expected = {p.name: 0 for p in self.cfg.policies}
        by_id = {s.episode_id: s for s in summaries}
        metrics: dict[str, float] = {}
        for p in self.cfg.policies:
            rewards, invalid, turns, calls, bad_calls = [], 0, 0, 0, 0
            for spec in specs:
                s = by_id[spec.episode_id]
                for seat, ref in spec.seats.items():
                    if ref.kind is PolicyKind.ADAPTER and ref.name == p.name and s.turns.get(seat, 0) > 0:
                        expected[p.name] += 1
                        rewards.append(s.rewards[seat])
                        invalid += s.invalid.get(seat, 0)
                        turns += s.turns.get(seat, 0)
                        calls += s.tool_calls.get(seat, 0)
                        bad_calls += s.invalid_tool_calls.get(seat, 0)
            metrics[f"train/{p.name}/reward"] = float(np.mean(rewards)) if rewards else float("nan")
            metrics[f"train/{p.name}/invalid_rate"] = invalid / max(turns, 1)
            if any(s.tool_calls for s in summaries):  # a game with tools: per episode of the policy
                metrics[f"train/{p.name}/tool_calls"] = calls / max(len(rewards), 1)
                metrics[f"train/{p.name}/invalid_tool_calls"] = bad_calls / max(len(rewards), 1)
        metrics.update(exploit)
        metrics.update(await deliver(step, specs, by_id, self.runners, self.learners, self.cfg.runtime.timeout_s))
        results = await asyncio.gather(
            *(
                self.learners[name].request(LearnerStep(step=step, expected=n, timeout_s=self.cfg.runtime.timeout_s,
                                                        datums=extra.get(name, []),
                                                        datums_only=self.cfg.train_for(name).all_actions_only),
                                            self.cfg.runtime.timeout_s + 30)
                for name, n in expected.items()
            )
        )
        # Only a step that trained moves the win rates: a step that failed and is played again
        # (a dead env runner) draws its league opponents from the same estimates.
        metrics.update(self._update_win_rates(specs, by_id))
        for name, res in zip(expected, results):
            assert isinstance(res, LearnerStepResult)
            metrics[f"train/{name}/version"] = res.version
            for k, v in res.metrics.items():
                metrics[f"train/{name}/{k}"] = v
        if self.cfg.league.snapshot_every and step % self.cfg.league.snapshot_every == 0:
            await self._snapshot(step)
            metrics["league/snapshots"] = float(sum(len(v) for v in self.league.values()))
        t2 = time.perf_counter()
        done = (await self._stats()).counters
        # The scheduler's compute by kind of request (sampling, learning, scoring, ...).
        kinds = {"SampleRequest", "ForwardBackward", "OptimStep"} | {
            k.split("/", 1)[1] for k in done if k.startswith("compute_ms/")}
        for key in sorted(kinds):
            k = f"compute_ms/{key}"
            metrics[f"perf/compute_s/{key}"] = (done.get(k, 0) - before.get(k, 0)) / 1000
        metrics.update({"timing_s/rollout": t1 - t0, "timing_s/learn": t2 - t1, "train/episodes": len(specs)})
        if "mem/peak_rss_bytes" in done:  # the scheduler's resident peak over this step (rollout and learning)
            metrics["perf/scheduler_peak_rss_mb"] = done["mem/peak_rss_bytes"] / 2**20
        for key in ("sample_batches", "sample_rows"):
            metrics[f"perf/{key}"] = after.get(key, 0) - before.get(key, 0)
        metrics.update(engine_metrics(before, after))
        self.transcripts = transcripts.render(step, summaries)
        if self.transcripts_path:
            transcripts.append(self.transcripts_path, self.transcripts)
        return metrics

    def _update_win_rates(self, specs: list[EpisodeSpec], by_id: dict[int, EpisodeSummary]) -> dict[str, float]:
        """Feed the step's games of every policy against another adapter (a snapshot, another
        policy) to the matchmaking win rates, one update per pair; returns the estimates
        (``league/<policy>/p_win/<opponent>``)."""
        tally: dict[tuple[str, str], np.ndarray] = {}
        for spec in specs:
            # The group's own seat (train_episodes: the policy in it, one opponent in the others).
            seat = next(a for a, g in spec.seat_groups.items() if g == spec.group_id)
            me = spec.seats[seat].name
            opp = next((r for a, r in spec.seats.items() if a != seat), None)
            if opp is None or opp.kind is not PolicyKind.ADAPTER or opp.name == me:
                continue  # a one-seat task, scripted, the base model, or plain self-play
            counts = tally.setdefault((me, opp.name), np.zeros(3, dtype=np.int64))
            counts[game_result(by_id[spec.episode_id].rewards, seat)] += 1
        out = {}
        for (policy, opp), (w, d, l) in sorted(tally.items()):
            self.win_rates.update(policy, opp, int(w), int(d), int(l))
            out[f"league/{policy}/p_win/{opp}"] = self.win_rates.p_win(policy, opp)
        return out

    async def _snapshot(self, step: int) -> None:
        """Freeze every policy as ``<policy>__s<step>``; drop the snapshots that leave the
        league (:func:`~opentinker.config.league_pool` of the next step)."""
        timeout = self.cfg.runtime.timeout_s
        for p in self.cfg.policies:
            name = f"{p.name}__s{step}"
            await self._scheduler(p.name).request(SnapshotAdapter(adapter=p.name, name=name), timeout)
            self.league[p.name].append(name)
            keep = set(league_pool(self.cfg, p.name, step + 1))
            for old in [n for n in self.league[p.name] if n not in keep]:
                await self._scheduler(old).request(DropAdapter(name=old), timeout)
                self.league[p.name].remove(old)
                self.win_rates.forget(old)

    # ----------------------------------------------------------------------------- evaluation

    def evaluate(self, step: int, head_to_head: bool, hands_per_stratum: int, progress: str = "") -> dict[str, float]:
        """Every policy against the random opponent and against each scripted policy in its
        opponent mix (stratified over the game's starts and seats), against its league
        snapshots (``league.eval_per_stratum``; not the one taken at this very step),
        optionally (``head_to_head``) against the base model and every other policy of the
        job, and the game's exact measures (its evaluation hook). Metrics are
        ``eval/<policy>/vs_<opponent>/<unit>`` (the hook's unit), ``ci95``, ``invalid_rate``,
        ``hands`` and, in a competitive game, ``wins`` / ``draws`` / ``losses``."""
        return self.loop.run(self._evaluate(step, head_to_head, hands_per_stratum, progress))

    async def _evaluate(self, step: int, head_to_head: bool, n: int, progress: str = "") -> dict[str, float]:
        t0 = time.perf_counter()
        out: dict[str, float] = {}
        eid = EVAL_STEP_BASE + step * 1_000_000
        # Every policy's pairings are played as one batch and the exact measures are asked
        # for at once: one policy after another, each batch was a few hands per engine step
        # and a job of seven policies spent 5x longer per hand evaluating than training.
        plan: list[tuple[str, list[tuple[str, PolicyRef, int]], list[list[EpisodeSpec]]]] = []
        for p in self.cfg.policies:
            # The random opponent always; every scripted partner of the policy's training mix
            # too (for a cooperative game, the partner it is meant to work with).
            partners = ["random", *sorted(o for o in p.opponents if o in SCRIPTED and o != "random")]
            jobs = [(o, PolicyRef(kind=PolicyKind.SCRIPTED, name=o), n) for o in partners]
            # Untrained, every policy is the base model: its games against the base model or
            # another policy would be mirror matches, so they are not played (blank cells).
            head_to_head = head_to_head and not self.untrained
            if head_to_head and self.cfg.eval.head_to_head_per_stratum > 0:
                jobs.append(("base", PolicyRef(kind=PolicyKind.BASE), self.cfg.eval.head_to_head_per_stratum))
            if self.cfg.league.eval_per_stratum > 0:  # against its own past selves (not the copy of now)
                jobs += [(name, PolicyRef(kind=PolicyKind.ADAPTER, name=name), self.cfg.league.eval_per_stratum)
                         for name in self.league[p.name] if name != f"{p.name}__s{step}"]
            if head_to_head and self.cfg.eval.cross_play_per_stratum > 0:  # the cross-play matrix
                jobs += [(q.name, PolicyRef(kind=PolicyKind.ADAPTER, name=q.name), self.cfg.eval.cross_play_per_stratum)
                         for q in self.cfg.policies if q.name != p.name]
            all_specs = []
            for _, opp, k in jobs:
                all_specs.append(strata_episodes(self.cfg, p.name, opp, k, eid))
                eid += len(all_specs[-1])
            plan.append((p.name, jobs, all_specs))
        flat = [s for _, _, all_specs in plan for specs in all_specs for s in specs]
        summaries = await self._run(flat, step, train=False, progress=progress)
        by_id = {s.episode_id: s for s in summaries}
        for name, jobs, all_specs in plan:
            for (label, _, _), specs in zip(jobs, all_specs):
                scores = pairing_metrics(self.game_eval, name, specs, [by_id[s.episode_id] for s in specs])
                out.update({f"eval/{name}/vs_{label}/{k}": v for k, v in scores.items()})
        if self.cfg.eval.exact:
            for measures in await asyncio.gather(*(self._exact_measures(p.name) for p in self.cfg.policies)):
                out.update(measures)
        out.update(self._rate(out, step))
        out["timing_s/eval"] = time.perf_counter() - t0
        return out

    def _rate(self, ev: dict[str, float], step: int) -> dict[str, float]:
        """Ratings of every player of this evaluation's pairings (:func:`rating_metrics`), in
        a competitive game whose config asks for them."""
        if not (self.cfg.eval.ratings and self.game_eval.competitive):
            return {}
        return rating_metrics(ev, self.ratings, anchor=RATING_ANCHOR, n_boot=self.cfg.eval.rating_bootstrap,
                              seed=(self.cfg.seed + step) & 0xFFFFFFFF)

    async def _exact_measures(self, policy: str) -> dict[str, float]:
        """The game's exact measures of ``policy`` (``eval/<policy>/<measure>``), from the
        scheduler's teacher-forced log-probs of every legal move's canonical reply, with the
        mass on those replies (``canonical_mass``) and the adapter version scored."""
        out: dict[str, float] = {}
        scored: dict[Any, tuple[Distribution, float, int]] = {}
        for m in self.game_eval.exact:
            if m.decisions not in scored:  # measures at the same decisions share one scoring
                scored[m.decisions] = await self._distribution(policy, m)
            dist, mass, version = scored[m.decisions]
            out[f"eval/{policy}/{m.name}"] = float(m.value(dist))
            out[f"eval/{policy}/canonical_mass"] = mass
            out[f"eval/{policy}/version"] = version
        return out

    async def _distribution(self, policy: str, m: ExactMeasure, spellings: tuple[str, ...] = SPELLINGS
                            ) -> tuple[Distribution, float, int]:
        """``policy``'s probability of each legal move at ``m``'s decisions (teacher-forced
        log-probs of the canonical replies in ``spellings``, at the job's sampling temperature:
        the policy as it plays), the mass on those replies, the version scored."""
        scored, version = await self._score_replies(policy, m, spellings)
        return scored.dist, scored.mass, version

    async def _score_replies(self, policy: str, m: ExactMeasure, spellings: tuple[str, ...] = SPELLINGS
                             ) -> tuple[Scored, int]:
        """:meth:`_distribution` with the sequences and their log-probs; the version scored."""
        key = (m.name, spellings)
        if key not in self._scored:  # the same for every policy and step: tokenized once
            decisions = m.decisions()
            self._scored[key] = (decisions, *policy_sequences(self.tok, self.cfg.system_prompt, decisions, spellings))
        decisions, seqs, n_reply = self._scored[key]
        res = await request_split_async(lambda q: self._scheduler(policy).request(q, self.cfg.runtime.timeout_s),
                                        LogprobsRequest(adapter=policy, sequences=seqs, tail=max(n_reply, default=0),
                                                        temperature=self.cfg.sampling.temperature))
        assert isinstance(res, LogprobsResult)
        dist, mass = policy_from_logprobs(res.logprobs, n_reply, decisions, spellings)
        return Scored(decisions, seqs, n_reply, res.logprobs, dist, mass), res.adapter_version

    async def _bare(self, policy: str, m: ExactMeasure) -> Scored:
        """``policy`` scored on the bare canonical replies, once per training step."""
        if (policy, m.name) not in self._step_scores:
            self._step_scores[(policy, m.name)] = (await self._score_replies(policy, m, BARE))[0]
        return self._step_scores[(policy, m.name)]

    async def _best_responses(self) -> tuple[dict[str, dict[str, str]], dict[str, float]]:
        """For every policy with ``best_response`` in its mix: a pure best response to it as it
        is now (the game's exact exploiter, from the bare canonical replies: a quarter of an
        evaluation's cost), and metrics (``train/<policy>/<measure>``: the measure, e.g. the
        exploitability, of that distribution at this step's start)."""
        m = self.game_eval.exploiter()
        tables: dict[str, dict[str, str]] = {}
        metrics: dict[str, float] = {}
        if m is None or m.best_response is None:  # (the config check refuses best_response then)
            return tables, metrics
        for p in self.cfg.policies:
            if p.opponents.get("best_response", 0) > 0:
                dist = (await self._bare(p.name, m)).dist
                tables[p.name] = dict(m.best_response(dist))
                metrics[f"train/{p.name}/{m.name}"] = float(m.value(dist))
        return tables, metrics

    async def _all_actions(self, step: int) -> tuple[dict[str, list], dict[str, float]]:
        """The exact all-actions datums of the policies that train on them
        (:mod:`opentinker.control.all_actions`), and their metrics."""
        m = self.game_eval.with_payoff()
        if m is None or not any(self.cfg.train_for(p.name).all_actions > 0 for p in self.cfg.policies):
            return {}, {}
        t0 = time.perf_counter()
        datums, metrics = await all_actions_terms(self.cfg, step, m, lambda name: self._bare(name, m), self.win_rates)
        metrics["timing_s/all_actions"] = time.perf_counter() - t0
        return datums, metrics

    # ----------------------------------------------------------------------------- outputs

    def save_adapters(self, folder: str) -> dict[str, str]:
        """Save every policy's adapter in PEFT format under ``folder/<policy>`` and its league
        snapshots under ``folder/league/<snapshot>``; returns the policies' paths."""
        async def _save() -> dict[str, str]:
            out = {}
            timeout = self.cfg.runtime.timeout_s
            current = {n for names in self.league.values() for n in names}
            stale = os.path.join(folder, "league")
            for old in (os.listdir(stale) if os.path.isdir(stale) else []):
                if old not in current:  # dropped from the league since an earlier save here
                    shutil.rmtree(os.path.join(stale, old), ignore_errors=True)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, LEAGUE_STATE), "w") as f:
                json.dump(self.league_state(), f)
            for p in self.cfg.policies:
                path = f"{folder}/{p.name}"
                await self._scheduler(p.name).request(SaveAdapter(adapter=p.name, path=path), timeout)
                out[p.name] = path
                for name in self.league[p.name]:
                    await self._scheduler(name).request(SaveAdapter(adapter=name, path=f"{folder}/league/{name}"),
                                                        timeout)
            return out

        return self.loop.run(_save())

    def load_adapters(self, folder: str, step: int = 0) -> dict[str, int]:
        """Replace every policy's adapter by the one saved under ``folder/<policy>`` (weights,
        optimizer state, version), and restore the league snapshots that exist after step
        ``step`` (frozen, from ``folder/league/``) and the league's win rates and ratings
        (``league_state.json``); returns the policies' versions. For ``--resume`` from the
        checkpoint of ``step``."""
        path = os.path.join(folder, LEAGUE_STATE)
        try:
            with open(path) as f:
                self.load_league_state(json.load(f))
        except FileNotFoundError:  # saved before leagues had win rates and ratings: start them afresh
            log.warning("%s: no %s (saved by an older version); win rates and ratings start afresh", folder,
                        LEAGUE_STATE)
            self._fresh_league()
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is corrupt: {e}") from None

        self.untrained = False
        self._step_scores = {}  # the adapters are replaced: nothing scored before stands

        async def _load() -> dict[str, int]:
            out = {}
            timeout = self.cfg.runtime.timeout_s
            for p in self.cfg.policies:
                sched = self._scheduler(p.name)
                await sched.request(DropAdapter(name=p.name), timeout)
                info = await sched.request(LoadAdapter(path=f"{folder}/{p.name}", name=p.name), timeout)
                out[p.name] = info.version
                for name in self.league[p.name]:
                    await sched.request(DropAdapter(name=name), timeout)
                self.league[p.name] = []
                for name in league_pool(self.cfg, p.name, step + 1):
                    path = f"{folder}/league/{name}"
                    if not os.path.isdir(path):
                        raise FileNotFoundError(f"league snapshot {name} of the checkpoint is missing: {path}")
                    await sched.request(LoadAdapter(path=path, name=name, trainable=False), timeout)
                    self.league[p.name].append(name)
            return out

        return self.loop.run(_load())

    def league_state(self) -> dict[str, Any]:
        """The league's state that is not a function of the config and the step: the
        matchmaking win rates and the running ratings (JSON; restored bit for bit)."""
        return {"win_rates": self.win_rates.state(), "ratings": self.ratings.state()}

    def _fresh_league(self) -> None:
        """The league state of a job that has played nothing."""
        self.win_rates = WinRates(decay=self.cfg.league.win_rate_decay)
        """Matchmaking's estimates of P[policy beats opponent] from training games."""
        self.ratings = RunningRatings(anchor=RATING_ANCHOR)
        """The running openskill table over every evaluated pairing."""

    def load_league_state(self, state: dict[str, Any]) -> None:
        self.win_rates = WinRates.from_state(state["win_rates"])
        self.win_rates.decay = self.cfg.league.win_rate_decay  # the config's (a resume may change it)
        self.ratings = RunningRatings.from_state(state["ratings"])

    def scheduler_stats(self) -> dict[str, Any]:
        async def _stats() -> Any:
            s = await self._stats()
            return {"counters": s.counters, "batches": s.batches}

        return self.loop.run(_stats())

    def recent_transcripts(self) -> list[str]:
        return list(self.transcripts)

