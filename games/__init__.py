"""Games: PettingZoo AEC dialogue games by versioned name, and scripted seats.

`make(name, **kwargs)` returns the order-enforced AEC env; registering a game is what puts it
under the conformance tests (`tests/test_games.py` parametrizes over `names()`). This package
imports only PettingZoo, Gymnasium, NumPy and the standard library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pettingzoo import AECEnv, ParallelEnv

from games import kuhn_poker, liars_dice, negotiation, prisoners_dilemma, referential, tictactoe, twenty_questions
from games.bridge import from_pettingzoo
from games.scripted import SCRIPTED, ScriptedPolicy, make_scripted

__all__ = [
    "SCRIPTED",
    "ScriptedPolicy",
    "from_pettingzoo",
    "make",
    "make_parallel",
    "make_scripted",
    "names",
    "parallel_names",
    "register",
]

_REGISTRY: dict[str, Callable[..., AECEnv]] = {}
_PARALLEL: dict[str, Callable[..., ParallelEnv]] = {}


def register(
    name: str,
    factory: Callable[..., AECEnv],
    *,
    parallel: Callable[..., ParallelEnv] | None = None,
) -> None:
    """Register `factory(**kwargs) -> AECEnv` under the versioned `name`; duplicates are errors.

    A simultaneous-move game also passes `parallel(**kwargs) -> ParallelEnv`, its Parallel
    form for `make_parallel`; `factory` must still give the AEC form (`parallel_to_aec`).
    """
    if name in _REGISTRY:
        raise ValueError(f"game {name!r} is already registered")
    _REGISTRY[name] = factory
    if parallel is not None:
        _PARALLEL[name] = parallel


def names() -> list[str]:
    """Registered game names, sorted."""
    return sorted(_REGISTRY)


def parallel_names() -> list[str]:
    """Registered games that also have a Parallel form (simultaneous moves), sorted."""
    return sorted(_PARALLEL)


def make(name: str, **kwargs: Any) -> AECEnv:
    """Make the AEC env registered as `name`, passing `kwargs` to its factory."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown game {name!r}; known games: {names()}")
    return _REGISTRY[name](**kwargs)


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


register("kuhn_poker_v0", kuhn_poker.env)
register("tictactoe_v0", tictactoe.env)
register("negotiation_v0", negotiation.env)
register("referential_v0", referential.env)
register("twenty_questions_v0", twenty_questions.env)
register("liars_dice_v0", liars_dice.env)
register("prisoners_dilemma_v0", prisoners_dilemma.env, parallel=prisoners_dilemma.parallel_env)
