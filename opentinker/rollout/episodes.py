"""Episodes: which ones a job plays (pure functions of the config, the root seed and the
step) and how one is played (:func:`play_episode`, shared by the env runner and the
single-process baseline of ``benchmarks/pipeline_pace.py``).

The game is driven through the PettingZoo AEC loop; scripted seats act inside the runner;
each LLM seat keeps a :class:`~opentinker.rollout.render.SeatRenderer`, so a turn adds only its delta
tokens, and every sample is seeded from the episode (seed, id, seat, turn). A scripted seat
named in ``RunEpisodes.learners`` is rendered and recorded like an LLM seat (its replies'
tokens as if sampled): the transcripts an offline SFT job learns from
(:mod:`opentinker.training.scripted_data`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, NamedTuple

import msgspec
import numpy as np

import games
from games.scripted import SCRIPTED, TABLE
from games.tool_use import ToolUse, find_tool_use
from opentinker.config import JobConfig, opponent_pool
from opentinker.rollout.matchmaking import WinRates, draw_opponent
from opentinker.rollout.render import ChatTokenizer, SeatRenderer
from protocols.messages import (
    EpisodeSpec,
    EpisodeSummary,
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SampleResult,
    SamplingParams,
    StopReason,
    Trajectory,
    Turn,
)

MAX_AGENT_STEPS = 1000
"""Upper bound on agent-steps in one episode: a game that runs longer is an error."""

SampleFn = Callable[[PolicyRef, np.ndarray, SamplingParams], Awaitable[SampleResult]]
"""``sample(policy, prompt_T, params)``: one reply from the scheduler (or an in-process host)."""
ScoreFn = Callable[[PolicyRef, np.ndarray, float, int], Awaitable[tuple[np.ndarray, int]]]
"""``score(policy, tokens_T, temperature, tail) -> (logprobs_T, adapter version)``: teacher-forced
log-probs of the last ``tail`` tokens of a sequence (for an exploring reply,
:attr:`RunEpisodes.explore`; ``LogprobsRequest.tail``)."""


def sample_seed(episode_seed: int, episode_id: int, seat_index: int, turn: int) -> int:
    """The seed of one decision's sample (63-bit). Episodes of a group share ``episode_seed``
    (hence the game's start) and differ in ``episode_id``, hence in their samples."""
    words = np.random.SeedSequence([episode_seed & 0xFFFFFFFF, episode_seed >> 32, episode_id, seat_index, turn])
    hi, lo = (int(w) for w in words.generate_state(2, np.uint32))
    return (hi << 31) | (lo >> 1)


def opponent_ref(policy: str, opponent: str) -> PolicyRef:
    """Who plays the other seat: ``self``, ``base``, a scripted policy or another policy
    (``past``, a league snapshot, is drawn by :func:`train_episodes`)."""
    if opponent in ("past", "best_response"):
        raise ValueError(f"opponent {opponent!r} is made by train_episodes, not named")
    if opponent == "self":
        return PolicyRef(kind=PolicyKind.ADAPTER, name=policy)
    if opponent == "base":
        return PolicyRef(kind=PolicyKind.BASE)
    if opponent in SCRIPTED:
        return PolicyRef(kind=PolicyKind.SCRIPTED, name=opponent)
    return PolicyRef(kind=PolicyKind.ADAPTER, name=opponent)


def game_agents(game: str, kwargs: dict | None = None) -> tuple[str, ...]:
    """The seats of a registered game made with ``kwargs``, in their order; ``ValueError``
    naming the game when it cannot be made with them."""
    return _game_agents(game, tuple(sorted((kwargs or {}).items())))


@functools.lru_cache(maxsize=None)
def _game_agents(game: str, kwargs: tuple) -> tuple[str, ...]:
    try:
        return tuple(games.make(game, **dict(kwargs)).possible_agents)
    except TypeError as e:  # an argument the factory does not take
        raise ValueError(f"game_kwargs {dict(kwargs)} for {game}: {e}") from None


def eval_starts(game: str) -> list[dict]:
    """The strata of an evaluation: game kwargs of each start, from the game's evaluation
    hook (by default 6 blocks of seeds, each played from every seat)."""
    return [dict(kw) for kw in games.evaluation(game).starts]


def train_episodes(cfg: JobConfig, step: int, win_rates: WinRates | None = None,
                   best_responses: dict[str, dict[str, str]] | None = None) -> list[EpisodeSpec]:
    """The episodes of training step ``step``: a pure function of the config, the step, (for
    prioritized matchmaking, ``league.matchmaking``) the coordinator's win rates and (for the
    opponent ``best_response``) each policy's best-response table ``{infostate: move}``.

    Each group is one start (one reset seed), one seat for the policy, one opponent drawn from
    the policy's mix for every other seat; ``group_size`` episodes differ only in sampling."""
    tc = cfg.train
    agents = game_agents(cfg.game, cfg.game_kwargs)
    rng = np.random.default_rng([cfg.seed & 0xFFFFFFFF, step, 1])
    specs: list[EpisodeSpec] = []
    eid = step * 1_000_000
    group = step * 100_000
    for p in cfg.policies:
        opps = sorted(p.opponents)
        w = np.asarray([p.opponents[o] for o in opps], dtype=np.float64)
        for _ in range(tc.groups_per_step):
            opp = opps[int(rng.choice(len(opps), p=w / w.sum()))]
            me = agents[int(rng.integers(len(agents)))]
            seed = int(rng.integers(1 << 62))
            if opp == "past":  # a past self of the league (itself before the first snapshot)
                pool = opponent_pool(cfg, p.name, step)
                weighting = cfg.league.matchmaking if win_rates is not None else "uniform"
                name = draw_opponent(rng, pool, win_rates or WinRates(), p.name, weighting,
                                     p=cfg.league.pfsp_power) if pool else p.name
                ref = PolicyRef(kind=PolicyKind.ADAPTER, name=name)
            elif opp == "best_response":  # an exact exploiter of the policy as it is now
                if not best_responses or p.name not in best_responses:
                    raise ValueError(f"policies[{p.name}]: the opponent best_response needs its table")
                ref = PolicyRef(kind=PolicyKind.SCRIPTED, name=TABLE, table=tuple(sorted(best_responses[p.name].items())))
            else:
                ref = opponent_ref(p.name, opp)
            seats = {a: PolicyRef(kind=PolicyKind.ADAPTER, name=p.name) if a == me else ref for a in agents}
            # Every seat is its own group: in self-play the two seats' rewards are not comparable.
            seat_groups = {a: group + i for i, a in enumerate(agents)}
            group += len(agents)
            for _ in range(tc.group_size):
                specs.append(
                    EpisodeSpec(
                        episode_id=eid, group_id=seat_groups[me], game=cfg.game,
                        game_kwargs=dict(cfg.game_kwargs), seed=seed, seats=seats,
                        seat_groups=seat_groups, train=True,
                    )
                )
                eid += 1
    return specs


def strata_episodes(cfg: JobConfig, policy: str, opponent: PolicyRef, n: int, first_id: int) -> list[EpisodeSpec]:
    """Evaluation episodes: ``n`` per (start, seat) (:func:`eval_starts`), the
    policy in that seat and ``opponent`` in every other; the same seeds every time, so
    evaluations before and after training are paired. ``group_id`` is the stratum."""
    agents = game_agents(cfg.game, cfg.game_kwargs)
    specs, eid = [], first_id
    for s, kwargs in enumerate(eval_starts(cfg.game)):
        for i, me in enumerate(agents):
            for k in range(n):
                seed = int(np.random.SeedSequence([cfg.seed & 0xFFFFFFFF, 99, s, i, k]).generate_state(1)[0])
                seats = {a: PolicyRef(kind=PolicyKind.ADAPTER, name=policy) if a == me else opponent for a in agents}
                specs.append(
                    EpisodeSpec(episode_id=eid, group_id=s * len(agents) + i, game=cfg.game,
                                game_kwargs={**cfg.game_kwargs, **kwargs}, seed=seed, seats=seats,
                                train=False)
                )
                eid += 1
    return specs


def invalid_count(env: Any, agent: str) -> int:
    """Invalid replies of ``agent`` so far (``invalid_counts`` of the text games and the bridge,
    else the ``invalid`` of its infos)."""
    counts = getattr(env.unwrapped, "invalid_counts", None)
    if counts is not None:
        return int(counts.get(agent, 0))
    return int(getattr(env.unwrapped, "infos", {}).get(agent, {}).get("invalid", 0))


def scripted_seat(ref: PolicyRef) -> games.ScriptedPolicy:
    """The scripted policy ``ref`` names: a registered one, or the ``table`` seat with the moves
    ``ref.table`` carries (``ValueError`` for a table seat without moves, or moves given to
    another policy)."""
    if (ref.name == TABLE) != bool(ref.table):
        raise ValueError(f"scripted seat {ref.name!r}: a table ({len(ref.table)} entries) goes with the seat "
                         f"{TABLE!r} and only with it")
    return games.make_scripted(ref.name, **({"table": dict(ref.table)} if ref.table else {}))


TRANSCRIPT_OBS_CHARS = 2000
"""Longest observation a transcript shows (the rest cut with a note)."""


def reply_tokens(tok: ChatTokenizer, text: str, max_tokens: int | None = None) -> np.ndarray:
    """``int32[S]``: a reply written as text, as the policy would sample it: its tokens (at most
    ``max_tokens - 1`` of them when given) and the stop token."""
    ids = tok.encode(text)
    return np.asarray((ids if max_tokens is None else ids[: max_tokens - 1]) + [tok.eos_id], dtype=np.int32)


def _cut(text: str) -> str:
    return text if len(text) <= TRANSCRIPT_OBS_CHARS else text[:TRANSCRIPT_OBS_CHARS] + f" ... [{len(text)} characters]"


@dataclass
class _Play:
    """One episode in play: its game, each LLM seat's renderer, and the bookkeeping of its
    decisions (per seat)."""

    spec: EpisodeSpec
    msg: RunEpisodes
    tok: ChatTokenizer
    env: Any
    agents: list[str]
    scripted: dict[str, games.ScriptedPolicy]
    shown: set[str]
    """Scripted seats named among the learners: rendered and recorded, their replies demonstrations."""
    rng: np.random.Generator
    """The scripted seats' draws."""
    explore_rng: np.random.Generator
    """Whether a learner's seat explores, and its move when it does."""
    tool_use: ToolUse | None
    renderers: dict[str, SeatRenderer]
    state_values: games.StateValues | None
    """The game's exact state values (the ``exact_gae`` critic), if it has them."""
    turns: dict[str, list[Turn]]
    totals: dict[str, float]
    invalid: dict[str, int]
    decisions: dict[str, int]
    transcript: list[str] = field(default_factory=list)

    def counts(self, agent: str) -> tuple[int, tuple[int, int]]:
        """``agent``'s invalid replies and (tool calls, invalid tool calls) so far."""
        calls = (self.tool_use.tool_calls[agent], self.tool_use.invalid_tool_calls[agent]) if self.tool_use else (0, 0)
        return invalid_count(self.env, agent), calls


class _Reply(NamedTuple):
    """An LLM seat's decision: the observation's tokens (``int32[O]``), the sample, its text."""

    obs_tokens: np.ndarray
    result: SampleResult
    text: str


async def play_episode(
    spec: EpisodeSpec,
    msg: RunEpisodes,
    tok: ChatTokenizer,
    sample: SampleFn,
    score: ScoreFn | None = None,
) -> tuple[EpisodeSummary, list[Trajectory]]:
    """Play one episode; LLM seats reply through ``sample(policy, prompt_T, params)``; in a
    training episode a learner's seat explores with probability ``msg.explore`` (a legal move
    drawn uniformly, scored through ``score``).

    Returns the episode's summary and, for a training episode, the trajectory of every seat
    played by a trainable policy named in ``msg.learners``, or by a scripted policy named there
    (its turns rendered as an LLM seat's would be, each reply's tokens :func:`reply_tokens` with
    log-probs 0: a demonstration).
    """
    play = _start_episode(spec, msg, tok, score)
    env = play.env
    for agent in env.agent_iter(max_iter=MAX_AGENT_STEPS):
        obs, _, term, trunc, info = env.last()
        if term or trunc:
            env.step(None)
            continue
        ref = spec.seats.get(agent)
        if ref is None:
            raise ValueError(f"episode {spec.episode_id}: no policy for seat {agent!r}")
        play.decisions[agent] += 1
        before = play.counts(agent)
        reply = None
        if agent in play.scripted:
            text = play.scripted[agent].act(obs["text"], info, play.rng)
            if agent in play.shown:
                reply = _demonstration(play, agent, obs["text"], info, text)
        else:
            reply = await _llm_reply(play, agent, ref, obs["text"], info, sample, score)
            text = reply.text
        valued = _game_value(play, agent, info) if reply is not None else _NOT_VALUED
        env.step(text)
        _record(play, agent, ref, before, text, reply, valued)
    else:
        if env.agents:
            raise RuntimeError(f"episode {spec.episode_id} did not end in {MAX_AGENT_STEPS} agent-steps")
    env.close()
    return _finish_episode(play)


def _start_episode(spec: EpisodeSpec, msg: RunEpisodes, tok: ChatTokenizer, score: ScoreFn | None) -> _Play:
    """Check the episode (``ValueError``: exploring without ``score``, a seat the game lacks),
    make its game at the start its seed gives, and a renderer for each LLM seat."""
    if msg.explore and spec.train and score is None:
        raise ValueError("exploring (RunEpisodes.explore > 0) needs a score function for the replies")
    explore_rng = np.random.default_rng([spec.seed & 0xFFFFFFFF, spec.seed >> 32, spec.episode_id, 11])
    env = games.make(spec.game, **spec.game_kwargs)
    env.reset(seed=spec.seed)
    agents = list(env.possible_agents)
    for agent in spec.seats:
        if agent not in agents:
            raise ValueError(f"episode {spec.episode_id}: {spec.game} has no seat {agent!r}")
    scripted = {a: scripted_seat(ref) for a, ref in spec.seats.items() if ref.kind is PolicyKind.SCRIPTED}
    # Scripted seats' stream: the episode's, or the group's shared by its episodes (common
    # random numbers, training only).
    stream = spec.group_id if msg.group_draws and spec.train else spec.episode_id
    rng = np.random.default_rng([spec.seed & 0xFFFFFFFF, spec.seed >> 32, stream, 7])
    tool_use = find_tool_use(env)
    shown = {a for a, ref in spec.seats.items() if a in scripted and ref.name in msg.learners}
    renderers = {a: SeatRenderer(tok, msg.system_prompt, tool_use.schemas(a) if tool_use else ())
                 for a in agents if a not in scripted or a in shown}
    return _Play(spec=spec, msg=msg, tok=tok, env=env, agents=agents, scripted=scripted, shown=shown, rng=rng,
                 explore_rng=explore_rng, tool_use=tool_use, renderers=renderers,
                 state_values=games.evaluation(spec.game).state_values,
                 turns={a: [] for a in agents}, totals={a: 0.0 for a in agents},
                 invalid={a: 0 for a in agents}, decisions={a: 0 for a in agents})


async def _llm_reply(play: _Play, agent: str, ref: PolicyRef, obs_text: str, info: dict[str, Any],
                     sample: SampleFn, score: ScoreFn | None) -> _Reply:
    """An LLM seat's decision: its renderer takes the observation (a ``tool`` message for a
    tool's result), then the reply is sampled, or, for an exploring learner, a legal move."""
    spec, msg, tok = play.spec, play.msg, play.tok
    r = play.renderers[agent]
    # A tool's result is a ``tool`` message of the template (mask 0 like any observation).
    tool_result = info.get("tool_result") is not None
    obs_tokens = r.observe(obs_text, "tool" if tool_result else "user")
    play.transcript.append(f"{agent} [{ref.label()}] {'gets the tool result' if tool_result else 'sees'}:")
    play.transcript.extend("    " + line for line in _cut(obs_text).splitlines())
    seed = sample_seed(spec.seed, spec.episode_id, play.agents.index(agent), len(play.turns[agent]))
    params = msgspec.structs.replace(
        msg.sampling, seed=seed, stop_token_ids=msg.sampling.stop_token_ids or (tok.eos_id,)
    )
    legal = list(info.get("legal_moves") or [])
    if (score is not None and msg.explore and spec.train and ref.kind is PolicyKind.ADAPTER
            and ref.name in msg.learners and legal and play.explore_rng.random() < msg.explore):
        result = await _explore(play, ref, r.prompt(), legal, score)
    else:
        result = await sample(ref, r.prompt(), params)
    sampled, stop = result.tokens[0], result.stop_reasons[0]
    r.add_reply(sampled, stop is StopReason.STOP)
    return _Reply(obs_tokens, result, tok.decode(sampled))


def _demonstration(play: _Play, agent: str, obs_text: str, info: dict[str, Any], text: str) -> _Reply:
    """A shown scripted seat's move ``text`` as the policy would have written it: the
    observation rendered as an LLM seat's (a ``tool`` message for a tool's result), the reply's
    tokens (:func:`reply_tokens`) with log-probs 0."""
    r = play.renderers[agent]
    obs_tokens = r.observe(obs_text, "tool" if info.get("tool_result") is not None else "user")
    sampled = reply_tokens(play.tok, text)
    r.add_reply(sampled, True)
    result = SampleResult(tokens=[sampled], logprobs=[np.zeros(len(sampled), np.float32)],
                          stop_reasons=[StopReason.STOP], adapter_version=0, batch_id=-1)
    return _Reply(obs_tokens, result, text)


async def _explore(play: _Play, ref: PolicyRef, prompt: np.ndarray, legal: list[Any], score: ScoreFn) -> SampleResult:
    """A legal move drawn uniformly as the reply to ``prompt`` (``int32[T]``), ended by eos,
    with the policy's log-probs of it (``score``)."""
    tok, sampling = play.tok, play.msg.sampling
    move = str(legal[int(play.explore_rng.integers(len(legal)))])
    reply = reply_tokens(tok, move, sampling.max_tokens)
    logprobs, version = await score(ref, np.concatenate([prompt, reply]), sampling.temperature, len(reply))
    return SampleResult(tokens=[reply], logprobs=[np.asarray(logprobs[-len(reply):], np.float32)],
                        stop_reasons=[StopReason.STOP], adapter_version=version, batch_id=-1)


class _Valued(NamedTuple):
    """What the game knows exactly of a decision (:func:`_game_value`)."""

    value: float | None = None
    move_tokens: np.ndarray | None = None
    move_values: np.ndarray | None = None
    move_values_by: dict[str, np.ndarray] = {}  # shared default, never mutated


_NOT_VALUED = _Valued()


def _game_value(play: _Play, agent: str, info: dict[str, Any]) -> _Valued:
    """The game's exact value of ``agent``'s decision state (its ``info["infostate"]``) in a
    training episode against one scripted opponent the game values (``GameEval.state_values``),
    and of each legal move there where the game values moves (``StateValues.moves``), with
    each move's canonical reply as the policy would sample it (:func:`reply_tokens`; their
    first tokens must differ, else no moves) and its value against each opponent the game
    values (``move_values_by``, in the same order of moves); empty otherwise."""
    values, spec = play.state_values, play.spec
    if values is None or not spec.train or "infostate" not in info:
        return _NOT_VALUED
    others = [ref for a, ref in spec.seats.items() if a != agent]
    if len(others) != 1 or others[0].kind is not PolicyKind.SCRIPTED or others[0].name not in values.opponents:
        return _NOT_VALUED
    state, opponent = str(info["infostate"]), others[0].name
    value = float(values.value(state, agent, opponent))
    if values.moves is None:
        return _Valued(value)
    moves = values.moves(state, agent, opponent)
    replies = [reply_tokens(play.tok, str(m), play.msg.sampling.max_tokens) for m in moves]
    if not moves or len({int(r[0]) for r in replies}) != len(replies):
        return _Valued(value)
    tokens = np.full((len(replies), max(len(r) for r in replies)), -1, np.int32)
    for i, r in enumerate(replies):
        tokens[i, : len(r)] = r
    by = {o: np.asarray([(values.moves(state, agent, o) if o != opponent else moves)[m] for m in moves], np.float32)
          for o in values.opponents}
    return _Valued(value, tokens, by[opponent], by)


def _record(play: _Play, agent: str, ref: PolicyRef, before: tuple[int, tuple[int, int]], text: str,
            reply: _Reply | None, valued: _Valued = _NOT_VALUED) -> None:
    """After ``agent``'s move ``text`` (``reply``: an LLM seat's, else None): whether the game
    took it (``before``: :meth:`_Play.counts` before it), its turn (with what the game knows
    exactly of the state it was made in, :func:`_game_value`), the rewards it paid (one paid to another
    seat goes to that seat's latest turn), its transcript line."""
    env = play.env
    invalid_before, calls_before = before
    bad = invalid_count(env, agent) > invalid_before
    play.invalid[agent] += int(bad)
    calls = play.counts(agent)[1]
    parse = (ParseOutcome.INVALID if bad else ParseOutcome.OK) if calls == calls_before else (
        ParseOutcome.INVALID_TOOL_CALL if calls[1] > calls_before[1] else ParseOutcome.TOOL_CALL)
    if reply is not None:
        result = reply.result
        play.turns[agent].append(
            Turn(
                obs_tokens=reply.obs_tokens,
                sampled_tokens=np.asarray(result.tokens[0], dtype=np.int32),
                sampler_logprobs=np.asarray(result.logprobs[0], dtype=np.float32),
                policy=msgspec.structs.replace(ref, version=result.adapter_version),
                stop_reason=result.stop_reasons[0],
                parse=parse,
                reward=float(env.rewards.get(agent, 0.0)),
                game_value=valued.value,
                move_tokens=valued.move_tokens,
                move_values=valued.move_values,
                move_values_by=valued.move_values_by,
            )
        )
    for a, rew in env.rewards.items():
        play.totals[a] += float(rew)
        if a != agent and rew and play.turns[a]:
            # A reward that arrives on another seat's move (a showdown, a rejected
            # proposal) belongs to this seat's latest decision.
            last = play.turns[a][-1]
            play.turns[a][-1] = msgspec.structs.replace(last, reward=last.reward + float(rew))
    who = ref if reply is None or agent in play.scripted else msgspec.structs.replace(ref, version=reply.result.adapter_version)
    play.transcript.append(f"{agent} [{who.label()}]: {text!r}" + ("  (invalid)" if bad else ""))


def _finish_episode(play: _Play) -> tuple[EpisodeSummary, list[Trajectory]]:
    """The episode's summary (its transcript ending with the outcome) and, for a training
    episode, the trajectories of the learners' seats."""
    spec, msg, totals, invalid, tool_use = play.spec, play.msg, play.totals, play.invalid, play.tool_use
    outcome = ", ".join(f"{a} {totals[a]:+g}" + (f" ({invalid[a]} invalid)" if invalid[a] else "") for a in play.agents)
    play.transcript.append("outcome: " + outcome)
    trajectories = []
    if spec.train:
        for agent, ref in spec.seats.items():
            if (ref.kind is PolicyKind.ADAPTER or agent in play.shown) and ref.name in msg.learners and play.turns[agent]:
                trajectories.append(
                    Trajectory(
                        episode_id=spec.episode_id,
                        group_id=spec.seat_groups.get(agent, spec.group_id),
                        seat=agent,
                        seed=spec.seed,
                        policy=ref.name,
                        turns=play.turns[agent],
                        total_reward=totals[agent],
                        step=msg.step,
                    )
                )
    summary = EpisodeSummary(
        episode_id=spec.episode_id, group_id=spec.group_id, seed=spec.seed,
        rewards=totals, invalid=invalid, turns=play.decisions, transcript=play.transcript,
        tool_calls=dict(tool_use.tool_calls) if tool_use else {},
        invalid_tool_calls=dict(tool_use.invalid_tool_calls) if tool_use else {},
    )
    return summary, trajectories
