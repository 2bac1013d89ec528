"""Split a request too large for one bus message into several that fit the receiver's limits,
and merge their replies into the one reply the whole request would have had.

A server refuses a message over its :class:`~protocols.codec.Limits` (``too_large``): more
than ``max_body_bytes`` of msgpack body, ``max_buffers`` arrays or ``max_bytes`` in all. A
request whose size grows with a job (the sequences of a ``LogprobsRequest``, the datums of a
``ForwardBackward``, the episodes of a ``RunEpisodes``) is sent as consecutive slices of its
list instead (:func:`split_request`), each a message of its own, and the replies are put
back together (:func:`merge_replies`).

Sizes are measured with the codec itself, not guessed (:func:`measure`): a request whose
encoding is within ``margin`` (half) of each limit goes whole, as it is; else each item is
encoded alone, and a slice's message is at most the message with an empty list, plus its
items, plus the few bytes by which the list's header, the items' array indices and the
header can grow once they sit in one message (:func:`bound`). Every slice is kept under the
margin, so a receiver with the default limits always takes it.

Requests the engine serves in batches of :data:`ENGINE_ROWS` rows are cut at multiples of
that many items (when a slice holds that many): the engine then forms the same batches as
for the whole request, and the results (log-probs, values, accumulated gradients) are the
same to the bit; a cut elsewhere changes them only by float rounding (~1 ulp). A
``ForwardBackward``'s datums are sliced in the order the scheduler computes them in
(:func:`protocols.messages.datum_order`), so each slice holds the parts the whole request's
would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec

from protocols import codec
from protocols.codec import Limits
from protocols.messages import (
    EpisodesDone,
    ForwardBackward,
    ForwardBackwardResult,
    LogprobsRequest,
    LogprobsResult,
    Message,
    RunEpisodes,
    ValuesRequest,
    ValuesResult,
    datum_order,
)

T = TypeVar("T")
M = TypeVar("M", bound=Message)

MARGIN = 0.5
"""A slice's share of each limit of the receiver, at most."""
ENGINE_ROWS = 64
"""Rows the engine forwards together (``chunk`` of ``ModelHost.logprobs``, ``values`` and
``forward_backward``): slices of a multiple of this many rows give bit-identical results."""
LIST_SLACK = 4
"""Bytes a msgpack list header can grow by from an empty list (1 byte) to any length (5)."""

SPLIT_FIELDS: dict[type, tuple[str, int]] = {
    LogprobsRequest: ("sequences", ENGINE_ROWS),
    ValuesRequest: ("sequences", ENGINE_ROWS),
    ForwardBackward: ("datums", ENGINE_ROWS),
    RunEpisodes: ("episodes", 1),
}
"""Request type -> (the list field that is split, the alignment of the cuts in items)."""


@dataclasses.dataclass(frozen=True)
class Cost:
    """What encoding something costs, in the terms of :class:`~protocols.codec.Limits`."""

    body: int
    """Bytes of the msgpack body."""
    buffers: int
    """Array buffers (frames after the body)."""
    nbytes: int
    """Bytes of all frames (header, body and buffers)."""

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.body + other.body, self.buffers + other.buffers, self.nbytes + other.nbytes)

    def fits(self, cap: Cost) -> bool:
        return self.body <= cap.body and self.buffers <= cap.buffers and self.nbytes <= cap.nbytes


ZERO = Cost(0, 0, 0)


def measure(obj: Any) -> Cost:
    """The exact :class:`Cost` of ``obj`` (a message, or an item of one: an array, a
    ``Datum``, an ``EpisodeSpec``, a list of them) as :func:`protocols.codec.encode` frames it."""
    frames = codec.encode(obj)
    return Cost(len(frames[1]), len(frames) - 2, sum(len(f) for f in frames))


def budget(limits: Limits | None = None, margin: float = MARGIN) -> Cost:
    """``margin`` of each bound of ``limits`` (default: the current
    :data:`protocols.codec.DEFAULT_LIMITS`, what a server takes unless told otherwise)."""
    lim = codec.DEFAULT_LIMITS if limits is None else limits
    return Cost(int(lim.max_body_bytes * margin), int(lim.max_buffers * margin), int(lim.max_bytes * margin))


def _uint_bytes(n: int) -> int:
    """Bytes of the msgpack encoding of the unsigned integer ``n``."""
    return 1 if n < 128 else 2 if n < 256 else 3 if n < 1 << 16 else 5 if n < 1 << 32 else 9


def bound(base: Cost, items: Cost) -> Cost:
    """An upper bound on the cost of a message that is ``base`` (its cost with an empty list)
    with items of total cost ``items`` (each measured alone) in that list: the list header may
    grow by :data:`LIST_SLACK` bytes, each array reference's buffer index (measured alone from
    0) by the size of the largest index in the message less one byte, and the header (measured
    with request id 0) up to :data:`protocols.codec.MAX_HEADER_BYTES`."""
    buffers = base.buffers + items.buffers
    grow = LIST_SLACK + buffers * (_uint_bytes(max(buffers - 1, 0)) - 1)
    return Cost(base.body + items.body + grow, buffers, base.nbytes + items.nbytes + grow + codec.MAX_HEADER_BYTES)


def split(
    items: Sequence[T],
    make: Callable[[list[T]], Message],
    limits: Limits | None = None,
    *,
    unit: int = 1,
    align: int = 1,
    margin: float = MARGIN,
) -> list[list[T]]:
    """Consecutive slices of ``items`` (in order, together all of them) such that each
    ``make(slice)`` is within ``margin`` of ``limits`` (:func:`budget`).

    Args:
        items: ``[N]`` what the message's list holds.
        make: the message holding a given list of items in ONE list field (and nothing else
            that depends on them).
        limits: the receiver's limits (default :data:`protocols.codec.DEFAULT_LIMITS`).
        unit: items that stay together: slices are cut only at multiples of ``unit`` (e.g. 2
            for the (chosen, rejected) datums of preference pairs); ``N`` must be one.
        align: a slice that can hold ``align`` items or more holds a multiple of ``align``
            (a multiple of ``unit``).
        margin: each slice's share of each limit, at most.

    Returns:
        ``[S]`` slices, at least one (``[[]]`` for no items: the request is still sent once).
        A unit over the budget alone is a slice of its own when its message is within
        ``limits`` themselves.

    Raises:
        ValueError: a unit whose message alone is over ``limits`` (no split can send it), or
            ``N``, ``align`` not multiples of ``unit``.
    """
    if unit < 1 or align % unit or len(items) % unit:
        raise ValueError(f"split: {len(items)} items and align {align} must be multiples of unit {unit} >= 1")
    cap, hard = budget(limits, margin), budget(limits, 1.0)
    whole = measure(make(list(items)))  # one encoding: most requests fit whole
    if dataclasses.replace(whole, nbytes=whole.nbytes + codec.MAX_HEADER_BYTES).fits(cap):
        return [list(items)]
    base = measure(make([]))
    units = [sum((measure(x) for x in items[i : i + unit]), ZERO) for i in range(0, len(items), unit)]
    cuts, start = [0], 0
    while start < len(units):
        end, total = start, ZERO
        while end < len(units) and bound(base, total + units[end]).fits(cap):
            total += units[end]
            end += 1
        if end == start:  # one unit alone is over the budget: alone, if the receiver takes it
            if not bound(base, units[start]).fits(hard):
                raise ValueError(f"split: item {start * unit} (cost {units[start]}) does not fit a message "
                                 f"within the receiver's limits ({hard})")
            end += 1
        elif end < len(units) and (end - start) * unit >= align:
            end = start + (end - start) * unit // align * align // unit
        cuts.append(end * unit)
        start = end
    return [list(items[a:b]) for a, b in itertools.pairwise(cuts)] or [[]]


def split_request(msg: M, limits: Limits | None = None, unit: int = 1, margin: float = MARGIN) -> list[M]:
    """``msg`` (a type of :data:`SPLIT_FIELDS`) as requests of consecutive slices of its list,
    every other field the same, each within ``margin`` of ``limits`` (see :func:`split`);
    ``[msg]`` itself when it fits whole."""
    field, align = SPLIT_FIELDS[type(msg)]

    def make(part: list[Any]) -> M:
        return msgspec.structs.replace(msg, **{field: part})

    items = getattr(msg, field)
    if isinstance(msg, ForwardBackward):  # in the order the scheduler computes them: its parts fall in one slice
        items = datum_order(items)
    parts = split(items, make, limits, unit=unit, align=align, margin=margin)
    return [msg] if len(parts) == 1 else [make(p) for p in parts]


def request_split(send: Callable[[Message], Message], msg: Message, unit: int = 1,
                  limits: Limits | None = None) -> Message:
    """``send`` (a blocking request, e.g. ``lambda m: sync_client.request(m, timeout)``) each
    slice of ``msg`` (:func:`split_request`) in order; their merged reply (:func:`merge_replies`)."""
    return merge_replies([send(m) for m in split_request(msg, limits, unit)])


async def request_split_async(send: Callable[[Message], Awaitable[Message]], msg: Message, unit: int = 1,
                              limits: Limits | None = None, concurrent: bool = False) -> Message:
    """:func:`request_split` with an awaitable ``send`` (e.g. ``client.request``): the slices
    one after the other (each after the previous one's reply: a state-changing request such as
    ``ForwardBackward`` is applied in order), or all at once when ``concurrent``."""
    parts = split_request(msg, limits, unit)
    if concurrent:
        return merge_replies(await asyncio.gather(*(send(m) for m in parts)))
    return merge_replies([await send(m) for m in parts])


def merge_replies(replies: Sequence[M]) -> M:
    """The reply to a whole request from the replies to its slices (:func:`split_request`),
    in the order of the slices; one reply is returned as it is.

    * ``LogprobsResult`` / ``ValuesResult``: the rows concatenated (the adapter's version
      must be the same in all).
    * ``EpisodesDone``: the summaries concatenated, ``trajectories_sent`` summed.
    * ``ForwardBackwardResult``: :func:`merge_forward_backward`.
    """
    if not replies:
        raise ValueError("merge_replies: no replies")
    if len(replies) == 1:
        return replies[0]
    first = replies[0]
    if any(type(r) is not type(first) for r in replies):
        raise TypeError(f"merge_replies: mixed replies {sorted({type(r).__name__ for r in replies})}")
    if isinstance(first, (LogprobsResult, ValuesResult)):
        field = "logprobs" if isinstance(first, LogprobsResult) else "values"
        versions = {r.adapter_version for r in replies}  # type: ignore[attr-defined]
        if len(versions) > 1:
            raise RuntimeError(f"merge_replies: slices were served by adapter versions {sorted(versions)}")
        return msgspec.structs.replace(first, **{field: [row for r in replies for row in getattr(r, field)]})
    if isinstance(first, EpisodesDone):
        return EpisodesDone(summaries=[s for r in replies for s in r.summaries],  # type: ignore[attr-defined,return-value]
                            trajectories_sent=sum(r.trajectories_sent for r in replies))  # type: ignore[attr-defined]
    if isinstance(first, ForwardBackwardResult):
        return merge_forward_backward(replies)  # type: ignore[arg-type,return-value]
    raise TypeError(f"merge_replies: cannot merge {type(first).__name__}")


def merge_forward_backward(results: Sequence[ForwardBackwardResult]) -> ForwardBackwardResult:
    """One ``ForwardBackwardResult`` for the slices of one ``ForwardBackward`` (all sent with
    the same ``normalizer`` and ``value_normalizer``, those of the whole batch, so the
    gradients they accumulate add up to the whole batch's).

    Metric keys are ``[<term>/]<name>`` (a term's metrics under its name, the main loss's
    bare), merged as the trainer merges its own row chunks:

    * ``loss`` and ``term/<name>`` (a loss sum over the global normalizer) are summed; so
      are the counts ``n_*`` (``n_tokens``, ``n_pairs``);
    * ``*_max`` is the largest;
    * every other metric is a mean, weighted by its term's ``n_pairs`` (preference losses)
      or else ``n_tokens``: exact for means over tokens or pairs (``clip_frac``,
      ``approx_kl``, ``nll_mean``, ``logp_diff_mean``, ``value_mse``, ...).

    Not exact (their token-weighted mean over the slices stands in, equal to the whole
    batch's value when there is one slice): ``logp_diff_p95``, a quantile, and
    ``explained_variance``, a ratio of variances; neither can be rebuilt from per-slice values.
    """
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for r in results:
        for key, v in r.metrics.items():
            head, _, name = key.rpartition("/")
            if key.startswith("term/") or name.startswith("n_"):
                sums[key], weights[key] = sums.get(key, 0.0) + v, 1.0
            elif name.endswith("_max"):
                sums[key], weights[key] = max(v, sums.get(key, v)), 1.0
            else:
                prefix = head + "/" if head else ""
                w = r.metrics.get(prefix + "n_pairs", r.metrics.get(prefix + "n_tokens", 1.0))
                sums[key], weights[key] = sums.get(key, 0.0) + v * w, weights.get(key, 0.0) + w
    metrics = {k: s / weights[k] if weights[k] else 0.0 for k, s in sums.items()}
    return ForwardBackwardResult(loss=sum(r.loss for r in results), metrics=metrics)
