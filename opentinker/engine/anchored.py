"""Adapter folders opened relative to a trusted root, one component at a time, never through a
symbolic link (``openat`` with ``O_NOFOLLOW``), so that nothing a peer does to the folders
between a check and a write can redirect the write.

A path checked once and then written by name is open to a race: an attack flipped
``run/race`` between a folder and a symbolic link to an outside folder while sending 60 saves
to ``run/race/aN``, and a complete adapter landed outside the run. Here the scheduler resolves
the path once (:func:`anchor`: the longest of its roots that holds it, and the components
below), then opens the root and each component from the descriptor of the one above with
``O_NOFOLLOW``: a component that is a link by then is refused (``ELOOP``), and the folder the
write lands in is the one the descriptor holds, whatever its name points to meanwhile. The
files of the new folder are written through ``/proc/self/fd/<fd>``, which names the folder
the descriptor holds (Linux; elsewhere the folder's path, resolved once), and the folder is
renamed into place with both names relative to the parent's descriptor.

A save never replaces what is not a saved adapter: the root itself (the run's folder), a file
(``config.toml``, ``metrics.jsonl``), a link, or a folder without ``opentinker.json``
(``checkpoints/``) is refused as the target. A load opens every file with ``O_NOFOLLOW``: a
weights file that is a link (to a file outside, or anywhere) is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from opentinker.files import root_holding

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_PROC_FD = Path("/proc/self/fd")


class PathNotAllowed(ValueError):
    """A path outside the folders a scheduler reads and writes, or through a symbolic link."""


@dataclass(frozen=True)
class Anchored:
    """A folder as a trusted ``root`` (resolved once, by the scheduler) and the names below it."""

    root: str
    parts: tuple[str, ...]

    def __str__(self) -> str:
        return os.path.join(self.root, *self.parts)

    @property
    def parent(self) -> Anchored:
        return Anchored(self.root, self.parts[:-1])


def anchor(path: str, roots: Sequence[str]) -> Anchored:
    """``path`` (absolute) resolved once, as the longest of ``roots`` (resolved already) that
    holds it and the names below; :class:`PathNotAllowed` when none holds it."""
    try:
        real = os.path.realpath(path)
    except OSError:  # a link that vanished while it was read: the path is being changed under us
        raise PathNotAllowed(f"adapter path {path!r}: changed while it was resolved") from None
    root = root_holding(real, roots)
    if root is None:
        raise PathNotAllowed(f"adapter path {path!r}: outside the folders this scheduler reads and writes "
                             "(the run's folder)")
    return Anchored(root, Path(real).relative_to(root).parts)


def folder_path(fd: int, fallback: str) -> Path:
    """A path that names the folder ``fd`` holds, whatever is renamed or linked meanwhile."""
    return _PROC_FD / str(fd) if _PROC_FD.is_dir() else Path(fallback)


@contextlib.contextmanager
def open_folder(where: Anchored, create: bool = False) -> Iterator[int]:
    """A descriptor of the folder ``where`` names, each component opened from the one above
    without following a link (made, mode 0o777 less the umask, when ``create``).

    Raises:
        PathNotAllowed: a component is a symbolic link or not a folder.
        ValueError: a component does not exist (and ``create`` is false).
    """
    if create:  # the root is the scheduler's own (resolved when it was given), made as a save's parents are
        os.makedirs(where.root, exist_ok=True)
    try:
        fd = os.open(where.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        raise ValueError(f"{where}: no such adapter folder") from None
    try:
        for i, name in enumerate(where.parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=fd)
            try:
                below = os.open(name, _DIR, dir_fd=fd)
            except OSError as e:
                shown = os.path.join(where.root, *where.parts[:i + 1])
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PathNotAllowed(f"{shown}: a symbolic link or not a folder (adapter folders are "
                                         "opened without following links)") from None
                raise ValueError(f"{where}: no such adapter folder") from None
            os.close(fd)
            fd = below
        yield fd
    finally:
        os.close(fd)


def open_file(folder_fd: int, name: str, shown: str) -> int:
    """A read-only descriptor of ``name`` in the folder ``folder_fd``, never through a link;
    ``ValueError`` naming ``shown`` when it is a link, missing or not a file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=folder_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{shown}: a symbolic link (refused: a saved adapter's files are its own)") from None
        raise ValueError(f"{shown}: missing ({os.strerror(e.errno or 0)})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{shown}: not a file")
    return fd


def read_file(folder_fd: int, name: str, shown: str) -> bytes:
    """The bytes of ``name`` in ``folder_fd`` (:func:`open_file`)."""
    fd = open_file(folder_fd, name, shown)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _is_adapter_folder(parent_fd: int, name: str, marker: str) -> bool:
    try:
        fd = os.open(name, _DIR, dir_fd=parent_fd)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.stat(marker, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
    finally:
        os.close(fd)


def _reason(e: BaseException) -> str:
    return os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e).split(" at path ")[0]


def write_folder_at(target: Anchored, fill: Callable[[Path], None], marker: str) -> None:
    """Write the folder ``target`` with ``fill(folder)`` in a new hidden folder beside it, then
    rename it into place (an existing saved adapter, with ``marker`` in it, is replaced whole),
    every name relative to the parent's descriptor.

    Raises:
        PathNotAllowed: ``target`` is the root itself, or names a file, a link, or a folder
            that is not a saved adapter; or a component on the way is a link.
    """
    if not target.parts:
        raise PathNotAllowed(f"adapter path {str(target)!r}: the run's folder itself cannot be an adapter's folder")
    name = target.parts[-1]
    with open_folder(target.parent, create=True) as parent:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not (stat.S_ISDIR(st.st_mode) and _is_adapter_folder(parent, name, marker)):
            raise PathNotAllowed(f"adapter path {str(target)!r}: holds something that is not a saved adapter (a save "
                                 "never replaces other files)")
        token = secrets.token_hex(4)
        tmp, old = f".{name}.tmp-{token}", f".{name}.old-{token}"
        os.mkdir(tmp, 0o700, dir_fd=parent)
        try:
            fd = os.open(tmp, _DIR, dir_fd=parent)
            try:
                fill(folder_path(fd, os.path.join(str(target.parent), tmp)))
            finally:
                os.close(fd)
            if st is not None:
                os.rename(name, old, src_dir_fd=parent, dst_dir_fd=parent)
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException as e:
            shutil.rmtree(tmp, dir_fd=parent, ignore_errors=True)
            if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":  # e.g. the folder removed meanwhile
                raise ValueError(f"adapter path {str(target)!r}: could not be written ({_reason(e)})") from None
            raise
        if st is not None:
            shutil.rmtree(old, dir_fd=parent, ignore_errors=True)
