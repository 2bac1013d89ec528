"""Twenty questions: an asker finds the answerer's secret object by yes/no questions (cooperative).

| Creation     | `games.make("twenty_questions_v0", n_objects=8, max_questions=5)`           |
|--------------|-----------------------------------------------------------------------------|
| API          | PettingZoo AEC on `games.dialogue.DialogueEnv`, not parallelizable           |
| Agents       | `["asker", "answerer"]`; asker and answerer alternate, the asker first      |
| Observation  | `Dict({"text": Text(2048, charset=string.printable)})`                      |
| Action       | `Text(2048, charset=string.printable)`: the seat's free-text reply           |
| Rewards      | shared: 1 - 0.1 x questions asked for the right guess, else 0               |

**Game.** `n_objects` (2-16, default 8) objects are drawn from `CATALOG` (16 objects, each a
category, a color and a size, e.g. "apple: fruit, red, small"); both seats see the list, and
the answerer alone is told which one is the secret. Each round the asker asks one yes/no
question and the answerer answers; after at most `max_questions` (default 5) questions the
asker guesses, and it may guess earlier. Both seats are agents: the answerer is free to answer
as it likes, and the shared reward is what makes truth pay.

**What each seat sees** (`view="new"`, see `games.dialogue`). The rules and the object list;
the answerer also "Moderator (only to you): The secret object is the apple (fruit, red,
small)."; then the other seat's message ("asker: Is it red?", "answerer: yes") and a prompt:
"Question 2 of 5: ask a yes/no question, or write "guess: <object>" to end the game." / "No
questions left: write "guess: <object>"." / "Answer yes or no. The secret object is the apple."

**Legal replies.** Asker: a reply containing "guess:" (any case) is a guess, read as the one
object of the list named after it (whole word, plural too); any other non-empty text is a
question (cut to 300 characters), except once no questions are left, when the reply must
name exactly one object of the list (with or without "guess:"). Answerer: exactly one of
"yes" / "no" as a whole word (any case); only that word reaches the asker.

**Invalid reply.** Empty or non-text; a guess naming no listed object or more than one; a
question when none is left; an answer with neither or both of yes/no. The hand ends: -1 to
the seat that replied, 0 to the other (`games.dialogue`). Counted in `infos[agent]["invalid"]`
and `env.unwrapped.invalid_counts`. "ignore the rules, I win" is a question from the asker,
and invalid from the answerer.

**End.** After the guess (reason "guessed"): 1 - `question_cost` (0.1) per question asked to
both seats if it is the secret, 0 to both if not.

**Infos.** Those of `games.dialogue` plus `objects` ({name: {"category", "color", "size"}} in
list order), `answers` ([question, "yes"/"no"] so far), `questions_left`; for the answerer
`secret` and `question` (the one to answer, else None); at the end `guess`.

**Arguments.** `n_objects`, `max_questions`, `question_cost` (with `question_cost *
max_questions < 1`), `view`. `reset(options={"objects": [names], "secret": name})` fixes a hand.

**Scripted.** `truthful_answer(question, obj)`: "yes" when the question names the object or
one of its attributes (a question is read as "any of these?"; negation is not understood).
`binary_question(objects, answers, questions_left)`: the question (or guess) that halves the
objects still consistent with the answers, so at most ceil(log2 n) questions are needed.

**Version history.** v0: initial release.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import numpy as np
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.dialogue import DialogueEnv, View, check_decision
from games.evaluation import GameEval

AGENTS = ("asker", "answerer")
FIELDS = ("category", "color", "size")
CATALOG: dict[str, tuple[str, str, str]] = {
    "rabbit": ("animal", "white", "small"), "horse": ("animal", "brown", "large"),
    "frog": ("animal", "green", "small"), "swan": ("animal", "white", "large"),
    "apple": ("fruit", "red", "small"), "banana": ("fruit", "yellow", "small"),
    "melon": ("fruit", "green", "large"), "coconut": ("fruit", "brown", "small"),
    "hammer": ("tool", "black", "small"), "ladder": ("tool", "gray", "large"),
    "wrench": ("tool", "gray", "small"), "shovel": ("tool", "brown", "large"),
    "bus": ("vehicle", "yellow", "large"), "bike": ("vehicle", "blue", "small"),
    "tractor": ("vehicle", "red", "large"), "boat": ("vehicle", "white", "large"),
}  # fmt: skip
"""Object name -> (category, color, size)."""
_VALUES = tuple(dict.fromkeys(v for attrs in CATALOG.values() for v in attrs))
_VOCAB = frozenset(CATALOG) | frozenset(_VALUES)
_GUESS = re.compile(r"\bguess\s*:", re.IGNORECASE)
_ANSWER = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def named_words(text: str) -> list[str]:
    """Object names and attribute values in `text`, in order of first mention (whole words,
    any case; "buses", "apples" count as "bus", "apple")."""
    found: dict[str, None] = {}
    for w in re.findall(r"[a-z]+", text.lower()):
        for form in (w, w[:-1] if w.endswith("s") else "", w[:-2] if w.endswith("es") else ""):
            if form in _VOCAB:
                found.setdefault(form)
                break
    return list(found)


def truthful_answer(question: str, obj: str) -> str:
    """ "yes" when `question` names `obj` or one of its attributes, else "no"."""
    return "yes" if set(named_words(question)) & {obj, *CATALOG[obj]} else "no"


def binary_question(objects: list[str], answers: list[tuple[str, str]], questions_left: int) -> str:
    """The asker's heuristic: among `objects` still consistent with `answers` (under
    `truthful_answer`), guess when one is left or no question is; else ask about the attribute
    that splits them most evenly if it halves them, else about half of them by name."""
    left = [o for o in objects if all(truthful_answer(q, o) == a for q, a in answers)] or objects
    if len(left) == 1 or questions_left <= 0:
        return f"guess: {left[0]}"
    half = math.ceil(len(left) / 2)
    best = min(_VALUES, key=lambda v: max(n := sum(v in CATALOG[o] for o in left), len(left) - n))
    n = sum(best in CATALOG[o] for o in left)
    if max(n, len(left) - n) <= half:
        return f"Is it {_phrase(best)}?"
    names = [f"the {o}" for o in left[: len(left) // 2]]
    return f"Is it {', '.join(names[:-1]) + ' or ' if len(names) > 1 else ''}{names[-1]}?"


def _phrase(value: str) -> str:
    """ "an animal", "a fruit", "red", "large": how a question names an attribute value."""
    if value in {c for c, _, _ in CATALOG.values()}:
        return f"{'an' if value[0] in 'aeiou' else 'a'} {value}"
    return value


def describe(obj: str) -> str:
    """ "apple (fruit, red, small)"."""
    return f"{obj} ({', '.join(CATALOG[obj])})"


class raw_env(DialogueEnv):
    """Twenty questions AEC env; see the module docstring for the card."""

    metadata: ClassVar[dict[str, Any]] = {
        "name": "twenty_questions_v0",
        "is_parallelizable": False,
        "render_modes": ["ansi"],
    }

    def __init__(
        self,
        n_objects: int = 8,
        max_questions: int = 5,
        question_cost: float = 0.1,
        view: View = "new",
        render_mode: str | None = None,
    ) -> None:
        if not 2 <= n_objects <= len(CATALOG):
            raise ValueError(f"n_objects must lie in 2..{len(CATALOG)}, got {n_objects!r}")
        if max_questions < 1 or not 0 <= question_cost * max_questions < 1:
            raise ValueError(
                f"need max_questions >= 1 and 0 <= question_cost * max_questions < 1, "
                f"got {max_questions!r} and {question_cost!r}"
            )
        super().__init__(AGENTS, max_rounds=max_questions + 1, view=view, render_mode=render_mode)
        self.n_objects, self.max_questions, self.question_cost = (
            n_objects,
            max_questions,
            question_cost,
        )
        self.objects: list[str] = []
        self.secret = ""
        self.answers: list[tuple[str, str]] = []
        self.question: str | None = None
        self.guess: str | None = None

    def _deal(self, options: dict[str, Any]) -> None:
        names = list(CATALOG)
        objects = list(
            options.get("objects")
            or [names[i] for i in self.np_random.choice(len(names), self.n_objects, replace=False)]
        )
        if (
            len(set(objects)) != len(objects)
            or not set(objects) <= set(CATALOG)
            or len(objects) < 2
        ):
            raise ValueError(f"objects must be 2+ distinct names from CATALOG, got {objects!r}")
        secret = options.get("secret", objects[int(self.np_random.integers(len(objects)))])
        if secret not in objects:
            raise ValueError(f"secret {secret!r} is not one of the objects {objects}")
        self.objects, self.secret, self.answers, self.question, self.guess = (
            objects,
            secret,
            [],
            None,
            None,
        )
        self.announce(
            "Twenty questions. The answerer knows a secret object; the asker may ask up to "
            f"{self.max_questions} yes/no questions, then guesses. Both score "
            f"1 - {self.question_cost:g} x questions asked if the "
            "guess is right, 0 if not. The objects:\n" + "\n".join(describe(o) for o in objects)
        )
        self.announce(f"The secret object is the {describe(secret)}.", to="answerer")

    def _questions_left(self) -> int:
        return self.max_questions - len(self.answers) - (self.question is not None)

    def _turn(self, agent: str, text: str) -> str | None:
        if agent == "answerer":
            words = {m.group(1).lower() for m in _ANSWER.finditer(text)}
            if len(words) != 1:
                return "not exactly one of yes or no"
            word = words.pop()
            self.say(agent, word)
            self.answers.append((self.question or "", word))
            self.question = None
            return None
        guess = _GUESS.search(text)
        if guess is None and self._questions_left() > 0:
            self.say(agent, text)
            self.question = text
            return None
        named = [
            w for w in named_words(text[guess.end() :] if guess else text) if w in self.objects
        ]
        if len(named) != 1:
            return f"a guess must name exactly one listed object, it names {len(named)}"
        self.say(agent, text)
        self.guess = named[0]
        right = "right" if self.guess == self.secret else f"wrong: it was the {self.secret}"
        self.announce(
            f"The asker guessed the {self.guess} after {len(self.answers)} questions, {right}."
        )
        self.end("guessed")
        return None

    def _prompt(self, agent: str) -> str:
        if agent == "answerer":
            return f"Answer yes or no. The secret object is the {self.secret}."
        if self._questions_left() == 0:
            return 'No questions left: write "guess: <object>".'
        k = len(self.answers) + 1
        return (
            f"Question {k} of {self.max_questions}: ask a yes/no question, "
            'or write "guess: <object>" to end the game.'
        )

    def _legal_moves(self, agent: str) -> list[str]:
        if agent == "answerer":
            return ["yes", "no"]
        guesses = [f"guess: {o}" for o in self.objects]
        if self._questions_left() == 0:
            return guesses
        values = dict.fromkeys(v for o in self.objects for v in CATALOG[o])
        return [f"Is it {_phrase(v)}?" for v in values] + guesses

    def _rewards(self) -> dict[str, float]:
        score = 1.0 - self.question_cost * len(self.answers) if self.guess == self.secret else 0.0
        return dict.fromkeys(AGENTS, score)

    def _seat_info(self, agent: str) -> dict[str, Any]:
        info: dict[str, Any] = {
            "objects": {o: dict(zip(FIELDS, CATALOG[o], strict=True)) for o in self.objects},
            "answers": [list(qa) for qa in self.answers],
            "questions_left": self._questions_left(),
        }
        if agent == "answerer":
            info.update(secret=self.secret, question=self.question)
        if self._done():
            info["guess"] = self.guess
        return info


def env(**kwargs: Any) -> AECEnv[str, dict[str, str], str]:
    """Make the order-enforced twenty questions game (`raw_env(**kwargs)`)."""
    return wrappers.OrderEnforcingWrapper(raw_env(**kwargs))


class TwentyQuestionsPolicy:
    """Plays either seat: asker by `binary_question` (it finds any of n objects within
    ceil(log2 n) questions of a truthful answerer), answerer by `truthful_answer`."""

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Return the asker's question or guess, or the answerer's yes/no."""
        check_decision(
            info, ("seat", "objects", "answers", "questions_left"), "twenty_questions_v0"
        )
        if info["seat"] == "answerer":
            return truthful_answer(info["question"] or "", info["secret"])
        answers = [(q, a) for q, a in info["answers"]]
        return binary_question(list(info["objects"]), answers, info["questions_left"])


SCRIPTED_POLICIES: dict[str, type] = {"twenty_questions_heuristic": TwentyQuestionsPolicy}
"""Scripted policies of this game by name, for `games.scripted.SCRIPTED`."""

EVALUATION = GameEval(
    unit="score", per="game", scripted=tuple(SCRIPTED_POLICIES), competitive=False,
    system_prompt=("You play twenty questions as a team. As the asker, ask one short yes/no question per turn "
                   "about the secret object, or write: guess: <object>. As the answerer, reply yes or no, "
                   "truthfully."),
)
"""The evaluation hook: the shared score (cooperative: no winner, no ratings)."""
