"""Games: PettingZoo AEC dialogue games by versioned name, and scripted seats.

`make(name, **kwargs)` returns the order-enforced AEC env; registering a game is what puts it
under the conformance tests (`tests/test_games.py` parametrizes over `names()`). This package
imports only PettingZoo, Gymnasium, NumPy and the standard library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pettingzoo import AECEnv

from games import kuhn_poker
from games.scripted import SCRIPTED, ScriptedPolicy, make_scripted

__all__ = ["SCRIPTED", "ScriptedPolicy", "make", "make_scripted", "names", "register"]

_REGISTRY: dict[str, Callable[..., AECEnv]] = {}


def register(name: str, factory: Callable[..., AECEnv]) -> None:
    """Register `factory(**kwargs) -> AECEnv` under the versioned `name`; duplicates are errors."""
    if name in _REGISTRY:
        raise ValueError(f"game {name!r} is already registered")
    _REGISTRY[name] = factory


def names() -> list[str]:
    """Registered game names, sorted."""
    return sorted(_REGISTRY)


def make(name: str, **kwargs: Any) -> AECEnv:
    """Make the AEC env registered as `name`, passing `kwargs` to its factory."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown game {name!r}; known games: {names()}")
    return _REGISTRY[name](**kwargs)


register("kuhn_poker_v0", kuhn_poker.env)
