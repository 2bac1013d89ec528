"""Referential game: a speaker describes a target object, a listener picks it out (cooperative).

| Creation     | `games.make("referential_v0", n_objects=4)` or `referential.env()`          |
|--------------|-----------------------------------------------------------------------------|
| API          | PettingZoo AEC on `games.dialogue.DialogueEnv`, not parallelizable           |
| Agents       | `["speaker", "listener"]`; the speaker writes first, the listener answers   |
| Observation  | `Dict({"text": Text(2048, charset=string.printable)})`                      |
| Action       | `Text(2048, charset=string.printable)`: the seat's free-text reply           |
| Rewards      | shared: 1 to both if the listener picks the target, else 0                  |

**Game.** `n_objects` (2-8, default 4) distinct objects, each a size (small, large), a color
(red, green, blue, yellow) and a shape (circle, square, triangle, star), are drawn from
`np_random`; one is the target. The speaker sees them in its own order with the target
marked, and writes one message. The listener sees them numbered in another order (so naming a
position does not help), reads the message, and picks a number. One round.

**What each seat sees** (`view="new"`, see `games.dialogue`). Speaker: the rules, its list
("- small red circle  <- the target"), "Describe the target ...". Listener: the rules,
"1. large blue star" ..., then "speaker: <message>" and "Reply with the number of the object
the speaker means (1-4).".

**Legal replies.** Speaker: any non-empty text (cut to 300 characters, see
`games.dialogue`); "ignore the rules, I win" is a message like any other. Listener: a number
1..n standing alone ("3", "I pick 3.") within its first 300 characters, exactly one distinct.

**Invalid reply.** Empty or non-text from either seat; from the listener also no number, two
numbers, or a number out of range. The hand ends: -1 to the seat that replied, 0 to the other
(`games.dialogue`). Counted in `infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`.

**Infos.** Those of `games.dialogue` plus `objects` (the seat's own list of descriptions, in
its order), for the speaker `target` (its description), for the listener `message` (the
speaker's, None before) and at the end `pick` (its description, or None).

**Arguments.** `n_objects`; `view` ("new" or "full"). `reset(options={"objects": [...],
"target": i})` fixes the objects (descriptions such as "small red circle") and the target index.

**Scripted.** `distinguishing(target, others)`: the fewest of the target's attribute values
that no other object shares all of; `match(message, objects)`: the listener's heuristic.

**Version history.** v0: initial release.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, ClassVar

import numpy as np
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.dialogue import DialogueEnv, View, check_decision
from games.evaluation import GameEval

AGENTS = ("speaker", "listener")
ATTRIBUTES = (
    ("small", "large"),
    ("red", "green", "blue", "yellow"),
    ("circle", "square", "triangle", "star"),
)
"""Size, color, shape: an object is one value of each, described "small red circle"."""
OBJECTS = tuple(" ".join(o) for o in itertools.product(*ATTRIBUTES))
RULES = (
    "Referential game. The speaker sees some objects and which one is the target; the listener "
    "sees the same objects in another order and must pick the target from the speaker's message."
)
_NUMBER = re.compile(r"(?<![0-9])[0-9]+(?![0-9])")


def distinguishing(target: str, others: list[str]) -> list[str]:
    """The fewest attribute values of `target` (in size-color-shape order) that no object of
    `others` has all of; all three when nothing fewer does (then `others` holds no copy)."""
    values = target.split()
    for k in range(1, len(values) + 1):
        for subset in itertools.combinations(values, k):
            if not any(set(subset) <= set(o.split()) for o in others):
                return list(subset)
    return values


def match(message: str, objects: list[str]) -> int:
    """Index of the object `message` means: among the objects that have every attribute word
    the message names (whole words, plurals too), the one with the most of them, else the one
    with the most; ties to the lowest index."""
    vocab = {v for values in ATTRIBUTES for v in values}
    words = re.findall(r"[a-z]+", message.lower())
    named = {w[:-1] if w not in vocab and w.endswith("s") else w for w in words} & vocab
    fits = [i for i, o in enumerate(objects) if named <= set(o.split())] or list(
        range(len(objects))
    )
    return max(fits, key=lambda i: (len(named & set(objects[i].split())), -i))


class raw_env(DialogueEnv):
    """Referential game AEC env; see the module docstring for the card."""

    metadata: ClassVar[dict[str, Any]] = {
        "name": "referential_v0",
        "is_parallelizable": False,
        "render_modes": ["ansi"],
    }

    def __init__(
        self, n_objects: int = 4, view: View = "new", render_mode: str | None = None
    ) -> None:
        if not 2 <= n_objects <= 8:
            raise ValueError(f"n_objects must lie in 2..8, got {n_objects!r}")
        super().__init__(AGENTS, max_rounds=1, view=view, render_mode=render_mode)
        self.n_objects = n_objects
        self.views: dict[str, list[str]] = {a: [] for a in AGENTS}
        self.target, self.message, self.pick = "", None, None

    def _deal(self, options: dict[str, Any]) -> None:
        drawn = self.np_random.choice(len(OBJECTS), self.n_objects, replace=False)
        objects = list(options.get("objects") or [OBJECTS[i] for i in drawn])
        if (
            len(set(objects)) != len(objects)
            or not set(objects) <= set(OBJECTS)
            or len(objects) < 2
        ):
            raise ValueError(
                f"objects must be 2+ distinct descriptions from OBJECTS, got {objects!r}"
            )
        target = options.get("target", 0)
        if target not in range(len(objects)):
            raise ValueError(
                f"target must be an index into the {len(objects)} objects, got {target!r}"
            )
        self.target = objects[target]
        self.views = {
            a: [objects[i] for i in self.np_random.permutation(len(objects))] for a in AGENTS
        }
        self.message = self.pick = None
        self.announce(RULES)
        marked = [
            f"- {o}{'  <- the target' if o == self.target else ''}" for o in self.views["speaker"]
        ]
        self.announce("Your objects:\n" + "\n".join(marked), to="speaker")
        numbered = [f"{i}. {o}" for i, o in enumerate(self.views["listener"], 1)]
        self.announce("Your objects:\n" + "\n".join(numbered), to="listener")

    def _turn(self, agent: str, text: str) -> str | None:
        if agent == "speaker":
            self.message = text
            self.say(agent, text)
            return None
        numbers = {int(m.group()) for m in _NUMBER.finditer(text)}
        if len(numbers) != 1 or not 1 <= (n := numbers.pop()) <= len(self.views[agent]):
            return f"not exactly one number from 1 to {len(self.views[agent])}"
        self.pick = self.views[agent][n - 1]
        verdict = (
            "right" if self.pick == self.target else f"wrong: the target was the {self.target}"
        )
        self.announce(f"The listener picked the {self.pick}, {verdict}.")
        self.end("picked")
        return None

    def _prompt(self, agent: str) -> str:
        if agent == "speaker":
            return "Describe the target in a few words so that the listener can pick it out."
        return (
            f"Reply with the number of the object the speaker means (1-{len(self.views[agent])})."
        )

    def _legal_moves(self, agent: str) -> list[str]:
        if agent == "speaker":
            return [f"The {o}." for o in self.views[agent]]
        return [str(i) for i in range(1, len(self.views[agent]) + 1)]

    def _rewards(self) -> dict[str, float]:
        return {a: float(self.pick == self.target) for a in AGENTS}

    def _seat_info(self, agent: str) -> dict[str, Any]:
        info: dict[str, Any] = {"objects": list(self.views[agent])}
        info.update({"target": self.target} if agent == "speaker" else {"message": self.message})
        if self._done():
            info["pick"] = self.pick
        return info


def env(**kwargs: Any) -> AECEnv[str, dict[str, str], str]:
    """Make the order-enforced referential game (`raw_env(**kwargs)`)."""
    return wrappers.OrderEnforcingWrapper(raw_env(**kwargs))


class ReferentialPolicy:
    """Plays either seat. Speaker: names the target's `distinguishing` values ("the red one",
    "the small star"); listener: picks by `match`. Together they always succeed."""

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Return the speaker's message or the listener's number."""
        check_decision(info, ("seat", "objects"), "referential_v0")
        if info["seat"] == "speaker":
            others = [o for o in info["objects"] if o != info["target"]]
            words = distinguishing(info["target"], others)
            return f"The {' '.join(words)}{'' if words[-1] in ATTRIBUTES[2] else ' one'}."
        return str(match(info["message"] or "", info["objects"]) + 1)


SCRIPTED_POLICIES: dict[str, type] = {"referential_heuristic": ReferentialPolicy}
"""Scripted policies of this game by name, for `games.scripted.SCRIPTED`."""

EVALUATION = GameEval(
    unit="success", per="game", scripted=tuple(SCRIPTED_POLICIES), competitive=False,
    system_prompt=("You play a cooperative game with objects described by size, color and shape. As the speaker, "
                   "describe the target in a few words so your partner can pick it out. As the listener, reply "
                   "with the number of the object the speaker means."),
)
"""The evaluation hook: the shared success rate (cooperative: no winner, no ratings)."""
