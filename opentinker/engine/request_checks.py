"""What a scheduler request may carry, checked when it arrives, before it is queued or batched
with another client's (:class:`~opentinker.engine.service.SchedulerService`): token arrays,
sampling and loss inputs (:func:`check_request`), a job's name, folders and probe file
(``OpenJob``), and the adapter paths a job may save to or load from (:func:`confined`,
:func:`placed`). Each raises ``ValueError`` (or :class:`PathNotAllowed`) naming the field."""

from __future__ import annotations

import hmac
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from opentinker.engine.anchored import Anchored, PathNotAllowed, anchor
from opentinker.engine.spec_checks import check_adam, check_spec
from opentinker.files import name_problem
from protocols.messages import (
    MOVE_INPUTS,
    CreateAdapter,
    ForwardBackward,
    LogprobsRequest,
    Message,
    OptimStep,
    SampleRequest,
    SamplingParams,
    ValuesRequest,
)

DEFAULT_MAX_NEW_TOKENS = 8192
"""The scheduler's own bound on ``SamplingParams.max_tokens`` (below the model's context)."""


def check_request(msg: Message, vocab_size: int, max_context: int | None = None,
                  max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, hidden_size: int | None = None) -> None:
    """Raise ``ValueError`` naming the field of ``msg`` whose arrays (dtype, rank, length, range)
    or sampling parameters no batch can take; called per request, before any batching, so a bad
    request fails alone: token ids in the vocabulary, every sequence within ``max_context``
    (a prompt with its ``max_tokens``), ``max_tokens`` at most ``max_new_tokens``. (What needs
    the model's state, such as an adapter's existence or the loss's inputs, is checked where the
    request runs.)"""
    if isinstance(msg, SampleRequest):
        from opentinker.engine.peft_sampler import validate_params

        validate_params(msg.params)
        n = msg.params.max_tokens
        if n > max_new_tokens:
            raise ValueError(f"SamplingParams.max_tokens {n} exceeds this scheduler's limit of {max_new_tokens}")
        room = None if max_context is None else max_context - n
        if room is not None and room < 1:
            raise ValueError(f"SamplingParams.max_tokens {n} leaves no room for a prompt in the model's context "
                             f"of {max_context} tokens")
        for i, p in enumerate(msg.prompts):
            check_tokens(p, f"SampleRequest.prompts[{i}]", vocab_size, room)
        if msg.forced is not None:
            check_forced(msg.forced, len(msg.prompts), [msg.params] * len(msg.prompts), vocab_size)
    elif isinstance(msg, (LogprobsRequest, ValuesRequest)):
        if isinstance(msg, LogprobsRequest) and not (math.isfinite(msg.temperature) and msg.temperature > 0):
            raise ValueError(f"LogprobsRequest.temperature must be finite and > 0, got {msg.temperature}")
        if isinstance(msg, LogprobsRequest) and msg.tail < 0:
            raise ValueError(f"LogprobsRequest.tail must be >= 0 (0: every token), got {msg.tail}")
        for i, seq in enumerate(msg.sequences):
            check_tokens(seq, f"{type(msg).__name__}.sequences[{i}]", vocab_size, max_context)
    elif isinstance(msg, CreateAdapter):
        check_spec(msg.spec, hidden_size)
    elif isinstance(msg, OptimStep):
        check_adam(msg.params)
    elif isinstance(msg, ForwardBackward):
        for i, d in enumerate(msg.datums):
            where = f"ForwardBackward.datums[{i}]"
            check_tokens(d.tokens, f"{where}.tokens", vocab_size, max_context)
            for k, v in d.loss_inputs.items():
                ndim = 2 if k in MOVE_INPUTS else 1  # [T, M]: a decision's moves
                if not isinstance(v, np.ndarray) or v.ndim != ndim or v.dtype.kind not in "biuf":
                    got = f"{v.ndim}-D {v.dtype}" if isinstance(v, np.ndarray) else type(v).__name__
                    raise ValueError(f"{where}.loss_inputs[{k!r}] must be a {ndim}-D numeric array, got {got}")
                if len(v) != len(d.tokens):
                    raise ValueError(f"{where}.loss_inputs[{k!r}] has length {len(v)}, tokens {len(d.tokens)}")
            ids = d.loss_inputs.get("move_tokens")
            if ids is not None and ids.size and (ids.dtype.kind not in "iu" or ids.min() < -1 or ids.max() >= vocab_size):
                raise ValueError(f"{where}.loss_inputs['move_tokens'] must be integer token ids below {vocab_size} "
                                 f"(-1: none), got {ids.dtype} from {ids.min()} to {ids.max()}")


def check_job_name(name: str) -> None:
    """``ValueError`` unless ``name`` can name a job (what a job config's ``name`` may be)."""
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(f"OpenJob.name: {problem}")


def _absolute(path: object) -> bool:
    """Whether ``path`` is an absolute path that can name a file (no NUL)."""
    return isinstance(path, str) and bool(path) and "\0" not in path and os.path.isabs(path)


def absolute_root(path: str, where: str) -> str:
    """``path`` with symbolic links resolved; ``ValueError`` naming ``where`` unless it is absolute."""
    if not _absolute(path):
        raise ValueError(f"{where}: {path!r} is not an absolute path")
    return os.path.realpath(path)


def check_probe(probe: str, text: str, roots: list[str]) -> None:
    """``ValueError`` unless ``probe`` lies in one of ``roots`` and holds ``text`` as this
    process reads it: the scheduler sees the job's folders as the job does."""
    path = os.path.realpath(probe)
    root = next((r for r in roots if path.startswith(r.rstrip(os.sep) + os.sep)), None)
    seen = b""
    if root is not None:
        try:
            with open(path, "rb") as f:
                seen = f.read(256)
        except OSError:
            seen = b""
    if root is None or not text or not hmac.compare_digest(seen, text.encode()):
        where = root or (roots[0] if roots else probe)
        raise ValueError(f"OpenJob.probe: this scheduler does not see {where} as the job wrote it: a job on another "
                         "machine needs its out_dir on a file system both machines share, at the same path")


def check_forced(forced: Sequence[Any], rows: int, params: Sequence[SamplingParams], vocab_size: int) -> None:
    """Raise ``ValueError`` naming ``SampleRequest.forced[i]`` unless there is one entry per
    row (``None``: the row draws) and each reply is token ids (:func:`check_tokens`) of 1 to
    its row's ``max_tokens``, with a stop token, if any, only at its end (a row ends at its
    first stop token)."""
    if len(forced) != rows:
        raise ValueError(f"SampleRequest.forced has {len(forced)} replies for {rows} prompts")
    for i, (f, q) in enumerate(zip(forced, params)):
        if f is None:
            continue
        check_tokens(f, f"SampleRequest.forced[{i}]", vocab_size, q.max_tokens)
        early = np.isin(f[:-1], q.stop_token_ids).nonzero()[0]
        if len(early):
            raise ValueError(f"SampleRequest.forced[{i}] has a stop token at {int(early[0])}, before its end")


def check_tokens(arr: Any, where: str, vocab_size: int, max_len: int | None = None) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``arr`` is a non-empty 1-D array of integer
    token ids in ``[0, vocab_size)`` (a float or bool array is not token ids, whatever its values),
    at most ``max_len`` long."""
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "iu":
        got = f"{arr.ndim}-D {arr.dtype}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(f"{where} must be a 1-D integer array of token ids, got {got}")
    if arr.size == 0:
        raise ValueError(f"{where} is empty")
    if max_len is not None and arr.size > max_len:
        raise ValueError(f"{where} has {arr.size} tokens, more than {max_len}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{where}: token id {lo if lo < 0 else hi} out of range [0, {vocab_size})")


def confined(path: str, roots: Sequence[str] | None) -> str:
    """``path`` with symbolic links resolved, if it lies inside one of ``roots`` (resolved
    already; ``None``: anywhere), else :class:`PathNotAllowed`. The message is the same whether or
    not the path exists, and nothing outside the roots is opened. (The write or read itself
    then opens it from its root without following links: :func:`placed`.)"""
    if roots is None:
        return path
    if not _absolute(path):
        raise PathNotAllowed(f"adapter path {path!r}: must be an absolute path inside the run's folder")
    return str(anchor(path, roots))


def placed(path: str, roots: Sequence[str] | None) -> str | Anchored:
    """Where a ``SaveAdapter`` or ``LoadAdapter`` of ``path`` is written or read: anchored at
    the longest of ``roots`` that holds it (opened from there without following links,
    :mod:`opentinker.engine.anchored`); the plain path when no root holds it and ``roots`` are
    not a bound (``None``: a scheduler that takes any path)."""
    if roots is None:
        return path
    return anchor(confined(path, roots), roots)
