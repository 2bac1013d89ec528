"""``opentinker play GAME``: a person plays a game in the terminal against a trained agent (a
saved adapter, or a run folder's first policy) or the base model.

Every game runs, the built-in ones and bridged PettingZoo envs alike (``opentinker play
pettingzoo.classic.<env>``, any importable AEC env constructor). The person sees their seat's
observation text (the env's own; the legal moves are in it, or listed from
``info["legal_moves"]``) and types a reply. A reply the game would count as invalid is refused
and asked again: it is first played on a trial env, rebuilt by replaying the game's steps from
the same seed (``copy.deepcopy`` is not enough: PettingZoo's classic envs pickle as their
constructor arguments, so a copy is a fresh, unreset env); the real env is stepped only with a
valid reply. End of input stops cleanly. The other seats reply as in training: each keeps a
:class:`~opentinker.rollout.render.SeatRenderer` and samples through the scheduler (a job with
only its scheduler, in this process), seeded per (game, seat, turn) like an episode's samples.
Game ``i`` (from 0) resets with seed ``--seed + i``; the person's seat alternates between games
unless ``--seat`` fixes it.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import games
from games.tool_use import find_tool_use
from opentinker.control.sources import (
    CliError,
    base_model,
    check_game,
    job_config,
    read_source,
    stage_adapters,
)
from opentinker.rollout.episodes import MAX_AGENT_STEPS, game_agents, invalid_count, sample_seed

FROZEN_SKIPS = ("optimizer.safetensors", "learner_state.json")
"""Files of a saved adapter that a frozen load never reads."""


def refusal(game: str, kwargs: dict, seed: int, history: list[str | None], env: Any, reply: str) -> str | None:
    """Why the game would count ``reply`` as invalid for the seat to act in ``env`` (reset
    with ``seed`` and stepped with ``history``), or ``None`` when it is valid. ``env`` is not
    touched: a trial env replays ``history`` (a deep copy when the replay does not reach the
    same observation)."""
    agent = env.agent_selection
    trial = games.make(game, **kwargs)
    trial.reset(seed=seed)
    for action in history:
        trial.step(action)
    if trial.agent_selection != agent or trial.last()[0].get("text") != env.last()[0].get("text"):
        trial = copy.deepcopy(env)  # a game that does not replay exactly (unseeded randomness)
    before = invalid_count(trial, agent)
    try:
        trial.step(reply)
    except Exception as e:  # noqa: BLE001  (the game refused it outright, whatever its error)
        return f" ({type(e).__name__}: {e})"
    return "" if invalid_count(trial, agent) > before else None


class Opponent:
    """The agent: samples replies from the scheduler of a scheduler-only job."""

    def __init__(self, client: Any, adapter: str | None, sampling: Any, tok: Any, system_prompt: str) -> None:
        self.client, self.adapter, self.sampling, self.tok, self.system_prompt = client, adapter, sampling, tok, system_prompt

    def reply(self, renderer: Any, seed: int) -> str:
        """Sample one reply to ``renderer``'s prompt and add it to the renderer."""
        import msgspec

        from protocols.messages import SampleRequest, StopReason

        params = msgspec.structs.replace(self.sampling, seed=seed, stop_token_ids=(self.tok.eos_id,))
        res = self.client.request(SampleRequest(adapter=self.adapter, prompts=[renderer.prompt()], params=params,
                                                client="play"), 600.0)
        renderer.add_reply(res.tokens[0], res.stop_reasons[0] is StopReason.STOP)
        return self.tok.decode(res.tokens[0])


def play_game(game: str, kwargs: dict, seed: int, index: int, human: str, agent: Opponent,
              inp: TextIO, out: TextIO) -> dict[str, float] | None:
    """One game; returns every seat's total reward, or ``None`` at the end of the input."""
    from opentinker.rollout.render import SeatRenderer

    def say(*lines: str) -> None:
        print(*lines, sep="\n", file=out, flush=True)

    env = games.make(game, **kwargs)
    env.reset(seed=seed)
    agents = list(env.possible_agents)
    tool_use = find_tool_use(env)
    renderers = {a: SeatRenderer(agent.tok, agent.system_prompt, tool_use.schemas(a) if tool_use else ())
                 for a in agents if a != human}
    turns = {a: 0 for a in agents}
    totals = {a: 0.0 for a in agents}
    history: list[str | None] = []
    for seat in env.agent_iter(max_iter=MAX_AGENT_STEPS):
        obs, _, term, trunc, info = env.last()
        if term or trunc:
            if seat == human:
                say("", f"--- the game is over (you are {human}) ---", obs["text"])
            env.step(None)
            history.append(None)
            continue
        if seat == human:
            say("", f"--- your turn ({human}) ---", obs["text"])
            legal = info.get("legal_moves") or []
            if legal and "legal moves:" not in obs["text"].lower():
                say(f"legal moves: {', '.join(map(str, legal))}")
            while True:
                print("> ", end="", file=out, flush=True)
                line = inp.readline()
                if not line:
                    return None
                text = line.strip()
                if not inp.isatty():  # piped: show what was read, as a terminal would have
                    print(text, file=out, flush=True)
                why = refusal(game, kwargs, seed, history, env, text)
                if why is None:
                    break
                say(f"{text!r} is not a legal move here{why}; try again.")
        else:
            renderers[seat].observe(obs["text"], "user" if info.get("tool_result") is None else "tool")
            before = invalid_count(env, seat)
            text = agent.reply(renderers[seat], sample_seed(seed, index, agents.index(seat), turns[seat]))
            turns[seat] += 1
        env.step(text)
        history.append(text)
        if seat != human:
            say(f"{seat} (agent): {text!r}" + ("  [invalid]" if invalid_count(env, seat) > before else ""))
        for a, r in env.rewards.items():
            totals[a] += float(r)
    env.close()
    return totals


def play(game: str, agent: str = "base", *, seat: str | None = None, n_games: int = 1, seed: int = 0,
         model: str | None = None, temperature: float | None = None, threads: int | None = None,
         device: str | None = None, inp: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """Play ``n_games`` of ``game`` with a person at ``inp``/``out`` against ``agent`` (a
    saved adapter or run folder, or ``base``); returns the exit status (0, also at the end of
    the input). :class:`CliError` when it cannot start."""
    from opentinker.bus import SyncClient
    from opentinker.bus.common import RemoteError
    from opentinker.config import MAX_TEMPERATURE, MIN_TEMPERATURE
    from opentinker.control.runtime import Job
    from opentinker.engine.model_specs import resolve_model
    from opentinker.rollout.render import ChatTokenizer
    from protocols.messages import LoadAdapter, SamplingParams

    check_game(game)
    if temperature is not None and not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise CliError(f"--temperature: between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, got {temperature:g}")
    source = None if agent == "base" else read_source(agent)
    with tempfile.TemporaryDirectory(prefix="opentinker-play-") as tmp:
        cfg = job_config(source, game, base_model(source, model), seed, threads, device, tmp)
        agents = list(game_agents(game, cfg.game_kwargs))
        if seat is not None and seat not in agents:
            raise CliError(f"--seat {seat!r}: {game} has the seats {', '.join(agents)}")
        try:
            model_path = resolve_model(cfg.model.base)
        except (OSError, ValueError) as e:
            raise CliError(f"model {cfg.model.base}: {e}") from None
        name = next(iter(source.adapters)) if source is not None else None
        staged = stage_adapters({name: source.adapters[name]}, Path(tmp), FROZEN_SKIPS) if source is not None and name else {}
        s = cfg.sampling
        sampling = SamplingParams(temperature=s.temperature if temperature is None else temperature,
                                  top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens)
        who = f"adapter {name} ({source.adapters[name]})" if source is not None and name else f"the base model ({cfg.model.base})"
        job = Job(cfg, model_path, run_dir=tmp, scheduler_only=True)
        try:
            with SyncClient(job.scheduler_endpoint, "play", credentials=job.scheduler_credentials) as client:
                for adapter, path in staged.items():
                    try:
                        client.request(LoadAdapter(path=path, name=adapter, trainable=False), cfg.runtime.timeout_s)
                    except RemoteError as e:  # e.g. an adapter of another base model
                        raise CliError(f"cannot load adapter {adapter}: {e.error.message}") from None
                opponent = Opponent(client, name, sampling, ChatTokenizer(model_path), cfg.system_prompt)
                print(f"opentinker play {game}: {n_games} game(s) against {who}, temperature "
                      f"{sampling.temperature:g}. Type a move and press Enter; end of input (Ctrl-D) stops.",
                      file=out, flush=True)
                if source is not None and source.config is not None and source.config.game != game:
                    print(f"note: the agent was trained on {source.config.game}", file=out, flush=True)
                mine = 0.0
                for i in range(n_games):
                    human = seat or agents[i % len(agents)]
                    print(f"\n=== game {i + 1}/{n_games} (seed {seed + i}): you are {human} ===", file=out, flush=True)
                    totals = play_game(game, dict(cfg.game_kwargs), seed + i, i, human, opponent, inp, out)
                    if totals is None:
                        print("\nend of input: stopped.", file=out, flush=True)
                        return 0
                    mine += totals[human]
                    print("rewards: " + ", ".join(f"{a} ({'you' if a == human else 'agent'}) {r:+g}"
                                                  for a, r in totals.items()), file=out, flush=True)
                print(f"\nyour total over {n_games} game(s): {mine:+g}", file=out, flush=True)
        finally:
            job.shutdown()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("game", help="a game name (opentinker games) or a PettingZoo env module, "
                        "e.g. pettingzoo.classic.<env>")
    parser.add_argument("--agent", default="base", metavar="PATH|base",
                        help="a saved adapter, a run folder (its first policy) or base (default)")
    parser.add_argument("--seat", help="your seat, e.g. player_0 (default: alternating from game to game)")
    parser.add_argument("--games", type=int, default=1, metavar="N", help="games to play (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="game i resets with seed SEED + i (default 0)")
    parser.add_argument("--model", help="base model (default: the run's, else the adapter's base if present, "
                        "else smollm2-135m)")
    parser.add_argument("--temperature", type=float, help="the agent's sampling temperature (default: the config's)")
    parser.add_argument("--threads", type=int, help="torch threads of the scheduler (default: every core)")
    parser.add_argument("--device", help="torch device (default: the run's, else cpu)")


def main(args: argparse.Namespace) -> int:
    """``opentinker play``: exit 0, or 2 with one line on stderr when it cannot start."""
    from opentinker.logs import escape_controls

    try:
        if args.games < 1:
            raise CliError(f"--games: at least 1, got {args.games}")
        return play(args.game, args.agent, seat=args.seat, n_games=args.games, seed=args.seed, model=args.model,
                    temperature=args.temperature, threads=args.threads, device=args.device)
    except CliError as e:
        print(f"opentinker play: {escape_controls(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstopped.", file=sys.stderr)
        return 130
