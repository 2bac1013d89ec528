"""Games: PettingZoo AEC dialogue games by versioned name, and scripted seats.

`make(name, **kwargs)` returns the order-enforced AEC env; registering a game is what puts it
under the conformance tests (`tests/test_games.py` parametrizes over `names()`). This package
imports only PettingZoo, Gymnasium, NumPy, jsonschema (tool arguments) and the standard library.

A name that is not registered but is a dotted module path, ``"pettingzoo.classic.connect_four_v3"``
(its ``env`` function) or ``"package.module:factory"``, is imported and its AEC env (a Parallel
env is converted) goes through :func:`from_pettingzoo`, unless it is a text game already (text
actions), so any PettingZoo env trains from a job config with no code; its ``game_kwargs`` go to
the env's constructor, except ``bridge_brief`` (true: the bridge's brief messages, see
:mod:`games.bridge`), which the bridge takes. Naming a module imports
it: a config is code you trust, like any Python module. ``evaluation(name)`` gives the game's
evaluation hook (:class:`games.evaluation.GameEval`): the one it registered, a module's
``EVALUATION`` attribute, or the default.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import re
import warnings
from collections.abc import Callable
from typing import Any

from gymnasium import spaces
from pettingzoo import AECEnv, ParallelEnv

from games import calculator, kuhn_poker, leduc_poker, liars_dice, negotiation, prisoners_dilemma, referential, tictactoe, twenty_questions
from games.bridge import from_pettingzoo
from games.evaluation import ExactMeasure, GameEval, StateValues
from games.scripted import SCRIPTED, ScriptedPolicy, make_scripted

__all__ = [
    "SCRIPTED",
    "ExactMeasure",
    "GameEval",
    "ScriptedPolicy",
    "StateValues",
    "evaluation",
    "from_pettingzoo",
    "make",
    "make_parallel",
    "make_scripted",
    "names",
    "parallel_names",
    "register",
    "resolve",
]

_REGISTRY: dict[str, Callable[..., AECEnv]] = {}
_PARALLEL: dict[str, Callable[..., ParallelEnv]] = {}
_EVALUATION: dict[str, GameEval] = {}
_MODULE_PATH = re.compile(r"[A-Za-z_][\w]*((\.[A-Za-z_][\w]*)+(:[A-Za-z_][\w]*)?|:[A-Za-z_][\w]*)")
"""A game named by its module: ``package.module`` (its ``env``), ``package.module:factory`` or,
for a single-file module on ``sys.path`` (the working folder), ``module:factory``."""

_EXTRAS = {"rlcard": "poker"}
"""Modules some PettingZoo envs import -> the extra that installs them."""

BRIDGE_BRIEF = "bridge_brief"
"""The ``game_kwargs`` key of an imported env that the bridge takes (its brief messages), not the env."""


def register(
    name: str,
    factory: Callable[..., AECEnv],
    *,
    parallel: Callable[..., ParallelEnv] | None = None,
    evaluation: GameEval | None = None,
) -> None:
    """Register `factory(**kwargs) -> AECEnv` under the versioned `name`; duplicates are errors.

    A simultaneous-move game also passes `parallel(**kwargs) -> ParallelEnv`, its Parallel
    form for `make_parallel`; `factory` must still give the AEC form (`parallel_to_aec`).
    `evaluation` is the game's evaluation hook (default: `GameEval()`).
    """
    if name in _REGISTRY:
        raise ValueError(f"game {name!r} is already registered")
    _REGISTRY[name] = factory
    if parallel is not None:
        _PARALLEL[name] = parallel
    if evaluation is not None:
        _EVALUATION[name] = evaluation


def resolve(name: str) -> Callable[..., AECEnv]:
    """The factory of game `name`: a registered one, or an importable PettingZoo env (see the
    module docstring); ``ValueError`` naming the game and why otherwise."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    return _imported(name)[0]


@functools.lru_cache(maxsize=64)
def _imported(name: str) -> tuple[Callable[..., AECEnv], GameEval]:
    if not _MODULE_PATH.fullmatch(name):
        close = difflib.get_close_matches(name, names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{name!r} is not a registered game; {hint}known: {', '.join(names())}, or a PettingZoo env "
                         "module such as 'pettingzoo.classic.connect_four_v3' (or 'package.module:factory', or "
                         "'module:factory' for a single file module.py in the folder opentinker runs in)")
    module_name, _, attr = name.partition(":")
    try:
        with warnings.catch_warnings():  # PettingZoo's notice about its own creation API
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(module_name)
    except ImportError as e:
        missing = (e.name or "").split(".")[0]
        extra = f"; pip install -e '.[{_EXTRAS[missing]}]' installs {missing}" if missing in _EXTRAS else ""
        raise ValueError(f"{name!r}: cannot import {module_name} ({type(e).__name__}: {e}){extra}") from None
    attr = attr or "env"
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{name!r}: {module_name} has no env constructor {attr!r}")
    label = name.rsplit(".", 1)[-1].replace(":", ".")

    def factory(**kwargs: Any) -> AECEnv:
        brief = kwargs.pop(BRIDGE_BRIEF, False)

        def inner() -> AECEnv:
            env = fn(**kwargs)
            if isinstance(env, ParallelEnv):
                from pettingzoo.utils.conversions import parallel_to_aec

                env = parallel_to_aec(env)
            if not isinstance(env, AECEnv):
                raise ValueError(f"{name!r}: {attr}() returned {type(env).__name__}, not a PettingZoo env")
            return env

        env = inner()
        if all(isinstance(env.action_space(a), spaces.Text) for a in env.possible_agents):
            if brief is not False:
                raise ValueError(f"{name!r}: {BRIDGE_BRIEF} is for an env the bridge converts; this one is a text game")
            return env  # a text game already
        env.close()
        return from_pettingzoo(inner, name=label, brief=brief)

    ev = getattr(module, "EVALUATION", None)
    if ev is not None and not isinstance(ev, GameEval):
        raise ValueError(f"{name!r}: {module_name}.EVALUATION is a {type(ev).__name__}, not a games.GameEval")
    return factory, ev or GameEval(
        system_prompt=f"You are playing the game {label}. Reply with one legal move only.",
        competitive=not _looks_cooperative(factory))


def _looks_cooperative(factory: Callable[..., AECEnv], episodes: int = 3, max_steps: int = 400) -> bool:
    """Whether a game without an evaluation hook looks cooperative: in random play (legal moves
    uniformly, a few episodes), every episode that ends gives all seats the same total, non-zero
    in at least one. Then it is scored as a team's reward, not with wins, losses and P(beats
    random); any episode with unequal totals (or none that ends) keeps it competitive. A module's
    ``EVALUATION = games.GameEval(competitive=...)`` says it outright."""
    import random

    rng = random.Random(0)
    shared = False
    for ep in range(episodes):
        env = factory()
        try:
            env.reset(seed=ep)
            totals = dict.fromkeys(env.possible_agents, 0.0)
            for agent in env.agent_iter(max_iter=max_steps):
                _, _, term, trunc, info = env.last()
                legal = list(info.get("legal_moves") or [])
                env.step(None if term or trunc else (str(rng.choice(legal)) if legal else ""))
                for a, r in env.rewards.items():
                    totals[a] = totals.get(a, 0.0) + float(r)
            if env.agents:
                continue  # did not end: no evidence either way
        finally:
            env.close()
        if len({round(v, 9) for v in totals.values()}) > 1:
            return False
        shared = shared or any(totals.values())
    return shared


def evaluation(name: str) -> GameEval:
    """The evaluation hook of game `name` (registered or imported; see the module docstring)."""
    if name in _REGISTRY:
        return _EVALUATION.get(name) or GameEval()
    return _imported(name)[1]


def names() -> list[str]:
    """Registered game names, sorted."""
    return sorted(_REGISTRY)


def parallel_names() -> list[str]:
    """Registered games that also have a Parallel form (simultaneous moves), sorted."""
    return sorted(_PARALLEL)


def make(name: str, **kwargs: Any) -> AECEnv:
    """Make the AEC env registered as `name`, passing `kwargs` to its factory."""
    return resolve(name)(**kwargs)


def make_parallel(name: str, **kwargs: Any) -> ParallelEnv:
    """Make the Parallel form of the game registered as `name`; ValueError for a turn-based game,
    which has only the AEC form that `make` gives."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown game {name!r}; known games: {names()}")
    if name not in _PARALLEL:
        with_parallel = sorted(_PARALLEL) or "none"
        raise ValueError(
            f"game {name!r} has no parallel form (it is turn-based); use games.make({name!r}) "
            f"for its AEC form. Games with a parallel form: {with_parallel}"
        )
    return _PARALLEL[name](**kwargs)


register("calculator_v0", calculator.env, evaluation=calculator.EVALUATION)
register("kuhn_poker_v0", kuhn_poker.env, evaluation=kuhn_poker.EVALUATION)
register("leduc_poker_v0", leduc_poker.env, evaluation=leduc_poker.EVALUATION)
register("tictactoe_v0", tictactoe.env, evaluation=tictactoe.EVALUATION)
register("negotiation_v0", negotiation.env, evaluation=negotiation.EVALUATION)
register("referential_v0", referential.env, evaluation=referential.EVALUATION)
register("twenty_questions_v0", twenty_questions.env, evaluation=twenty_questions.EVALUATION)
register("liars_dice_v0", liars_dice.env, evaluation=liars_dice.EVALUATION)
register("prisoners_dilemma_v0", prisoners_dilemma.env, parallel=prisoners_dilemma.parallel_env,
         evaluation=prisoners_dilemma.EVALUATION)
