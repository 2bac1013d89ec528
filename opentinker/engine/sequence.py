"""One sampling row of the engine: its tokens, its KV blocks and where it stands.

A :class:`Sequence` is created per prompt row of a ``SampleRequest``. It waits until the step
loop admits it (KV blocks for its prompt and every token it may draw are reserved at once, so
a running row never runs out of blocks and nothing is preempted), then runs: each step
computes a chunk of its not-yet-computed tokens (the prompt in chunks under the step's token
budget, then one token per step) and, when the chunk reaches its last token, draws the next
one. ``num_computed`` counts the tokens whose keys and values are in the pool; the token just
drawn has none until the next step feeds it.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opentinker.engine.kv_cache import Allocation
from protocols.messages import SamplingParams, StopReason


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A row being sampled. ``tokens`` is the prompt followed by every drawn token."""

    seq_id: int
    adapter: str | None
    """Adapter name, ``None`` for the bare base model."""
    prompt: np.ndarray
    """``int32[P]``, P >= 1."""
    params: SamplingParams
    seed: int
    """The row's seed: its randomness is a function of (seed, position) alone."""
    owner: Any = None
    """Whoever submitted it (the scheduler service: its request and row index)."""
    forced: np.ndarray | None = None
    """``int32[F]``: the reply given instead of drawn (``SampleRequest.forced``): the row takes
    ``forced[k]`` as its ``k``-th token, with its log-prob, and ends after the last."""
    tokens: list[int] = field(default_factory=list)
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    """Leading tokens whose K/V are in the pool (cached prefix included)."""
    num_cached: int = 0
    """Of those, how many came from the prefix cache at admission."""
    streamed: int = 0
    """Drawn tokens already reported as partial results."""
    status: SeqStatus = SeqStatus.WAITING
    stop_reason: StopReason | None = None
    cancelled: bool = False
    error: Exception | None = None
    """Why it ended without a reply (an adapter dropped while it waited, or one that cannot
    fit the memory budget): its request fails with this error."""
    namespace: Hashable | None = None
    """The prefix-cache key it was admitted under: (model copy, adapter, version)."""
    version: int = -1
    """The adapter's version at admission (-1: the base model)."""
    alloc: Allocation | None = None
    slots_S: np.ndarray | None = None
    """``int64[S]`` pool slot of every position it may fill (prompt + max_tokens), fixed at admission."""
    row_slot: int = -1
    """Its slot in the running batch, ``[0, max_rows)``, while admitted (-1 otherwise): the
    model runner keeps its sampling parameters and block table there."""
    twins: list[Sequence] = field(default_factory=list)
    """Waiting rows with this row's namespace and prompt, admitted while it computes that
    prompt: they take its prompt's keys, values and last logits instead of computing them."""
    leader: Sequence | None = None
    """The row whose prompt this twin waits on (``None`` once it runs on its own)."""
    waited: int = 0
    """Admissions it stayed waiting through while the KV pool was short (the scheduler's
    warm-first order gives way to arrival order past :data:`~opentinker.engine.scheduler.WARM_FIRST_PATIENCE`)."""

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = [int(t) for t in self.prompt]

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def pending(self) -> int:
        """Tokens still to be computed before the next draw (1 for a decoding row)."""
        return len(self.tokens) - self.num_computed

    @property
    def forced_next(self) -> int:
        """The token this row takes at its next draw instead of drawing one (-1: it draws)."""
        k = len(self.out_tokens)
        return int(self.forced[k]) if self.forced is not None and k < len(self.forced) else -1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
