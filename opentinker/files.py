"""Files written whole or not at all: a run's state (learner states, metrics rewritten on
resume, checkpoint manifests, a service's credentials) must never be left half written by a
crash or a full disk, since ``--resume`` and the checks of a checkpoint read them back."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

MAX_NAME_BYTES = 128
"""A job name is part of the run folder's name (``{game}__{name}__{seed}__{time}``), which
must fit the 255 bytes a file system allows for one path component."""
_NAME = re.compile(r"\w[\w.+-]*")
"""A job name: word characters (letters, digits, ``_``, in any script), ``.``, ``+``, ``-``,
never first a ``.`` or ``-``: no separator, no ``..``, no control character, no option."""


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a job (a folder of its own, for the config and the scheduler's
    tenants alike): not a safe path component (:data:`_NAME`) or over :data:`MAX_NAME_BYTES`
    bytes in UTF-8; ``None`` when it can."""
    if not _NAME.fullmatch(name):
        return f"{name!r} is not a safe folder name: use letters, digits, _ . + - (not . or - first)"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"{len(name.encode())} bytes long, at most {MAX_NAME_BYTES}"
    return None


@contextlib.contextmanager
def replaced(path: str | Path, *, binary: bool = False, mode: int = 0o666) -> Iterator[IO[Any]]:
    """Write ``path`` atomically: the block writes to a new temporary file beside it (created
    with ``mode``, less the umask), which replaces ``path`` once the block ends; if the block
    raises, the temporary file is removed and ``path`` is untouched. Writers in other threads or
    processes never share a temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, text: str, *, mode: int = 0o666) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`replaced`); returns ``path``."""
    with replaced(path, mode=mode) as f:
        f.write(text)
    return Path(path)


def root_holding(real: str, roots: Sequence[str]) -> str | None:
    """The longest of ``roots`` (resolved paths) that is ``real`` (a resolved path) or holds
    it; None when none does. Comparison is by whole names: ``/a/bc`` is not inside ``/a/b``."""
    inside = [r for r in roots if real == r or real.startswith(r.rstrip(os.sep) + os.sep)]
    return max(inside, key=len) if inside else None
