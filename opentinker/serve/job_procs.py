"""The processes of a service's queued jobs: started in the service's process tree, stopped
with it, and found again by a service started after one that died.

An attack submitted 200 small jobs to a service and sent SIGTERM to its process group: 163 job
processes kept running (each job was started in a session of its own, out of the group's
reach, and stopped one at a time). Here:

* a job is started in its own process group (so that it and every process it starts, e.g.
  Ray's workers, are signalled together), with ``PR_SET_PDEATHSIG`` (Linux): if the service
  dies, even by SIGKILL, the job's process gets SIGTERM from the kernel. The death signal
  follows the *thread* that started the process, so the queue starts every job from its one
  long-lived thread;
* :func:`stop_all` sends SIGTERM to every job's group at once, waits for all of them together
  (one grace period, not one per job), then SIGKILLs the groups left;
* each job's pid, group and start time are recorded in its folder (``proc.json``), and the
  queue's folder records its service's (``owner.json``): :func:`clean_orphans`, run when a
  service starts, stops the jobs of a service that is no longer running (its pid gone, or
  reused by another process: start times are compared, so a reused pid is never signalled).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

PROC_FILE = "proc.json"
OWNER_FILE = "owner.json"
GRACE_S = 20.0
"""How long stopping jobs waits for them to end after SIGTERM before SIGKILL."""
_PR_SET_PDEATHSIG = 1


def proc_stat(pid: int) -> tuple[str, list[str]] | None:
    """Process ``pid``'s name and the fields of ``/proc/<pid>/stat`` after it (field 3, the
    state, first: ``fields[k]`` is the file's field ``k + 3``), or None when there is no such
    process (or no ``/proc``). The name may hold spaces and parentheses: it ends at the last
    ``)``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field
    22), or None when there is no such process (or no ``/proc``)."""
    stat = proc_stat(pid)
    return None if stat is None else int(stat[1][19])


_prctl = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None  # looked up before any fork


def die_with_parent() -> None:  # runs in the child between fork and exec: no imports, no locks
    """``preexec_fn`` of a child that gets SIGTERM when the thread that started it dies (Linux)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def start(command: Sequence[str], folder: Path, log_file: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``command`` in ``folder`` as a job: its own process group, SIGTERM when the
    calling thread's process dies, its output to ``log_file``, its pid recorded in
    ``folder/proc.json``."""
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                process_group=0, preexec_fn=die_with_parent)  # noqa: PLW1509 - no threads in the child
    record = {"pid": proc.pid, "start_time": start_time(proc.pid)}
    (folder / PROC_FILE).write_text(json.dumps(record))
    return proc


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every job's process group at once; SIGKILL to the groups of those still
    running after ``grace_s`` (all waited for together)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in live:
        _signal_group(p.pid, signal.SIGKILL)  # the group too: what the job started may outlive it
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def claim(folder: Path) -> None:
    """Mark the queue's ``folder`` as this process's (``owner.json``: pid and start time)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    (folder / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start_time": start_time(os.getpid())}))


def _alive(record: dict) -> bool:
    """The process a record names is running (same pid and start time)."""
    pid = record.get("pid")
    return isinstance(pid, int) and pid > 0 and start_time(pid) is not None and start_time(pid) == record.get(
        "start_time")


def clean_orphans(parent: Path, grace_s: float = GRACE_S) -> list[int]:
    """Stop the jobs left by services that are no longer running: every ``jobs-*`` folder in
    ``parent`` whose ``owner.json`` names a process gone, each of whose ``q*/proc.json`` names
    a process still running (same start time). Returns the pids stopped; the folders are
    renamed ``*.ended`` (their logs kept)."""
    stopped: list[int] = []
    for folder in sorted(parent.glob("jobs-*")):
        if folder.suffix == ".ended" or not folder.is_dir() or folder.is_symlink():
            continue
        try:
            owner = json.loads((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not a queue's folder (or from before owners were recorded)
        if _alive(owner):
            continue
        orphans = []
        for record_file in folder.glob(f"q*/{PROC_FILE}"):
            try:
                record = json.loads(record_file.read_text())
            except (OSError, ValueError):
                continue
            if _alive(record):
                orphans.append(record["pid"])
        for pid in orphans:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(start_time(p) is not None for p in orphans) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in orphans:
            _signal_group(pid, signal.SIGKILL)
        if orphans:
            log.warning("queue: stopped %d job(s) left running by a service that ended (%s): pids %s", len(orphans),
                        folder.name, orphans)
        stopped += orphans
        with contextlib.suppress(OSError):
            folder.rename(folder.with_name(folder.name + ".ended"))
    return stopped
