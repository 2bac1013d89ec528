"""A process's resident memory and its peak, from the kernel (no torch: the scheduler's bus
side reports them in its counters)."""

from __future__ import annotations


def process_memory() -> dict[str, int]:
    """This process's resident memory now and its peak (``mem/rss_bytes``,
    ``mem/peak_rss_bytes``: the kernel's ``VmRSS`` and ``VmHWM``); empty where there is no
    ``/proc``."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "VmHWM:")))
        return {"mem/rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
                "mem/peak_rss_bytes": int(fields["VmHWM"].split()[0]) * 1024}
    except (OSError, KeyError, ValueError):
        return {}


def reset_peak_memory() -> bool:
    """Start the kernel's peak-RSS mark (``VmHWM``) again at the current RSS (Linux'
    ``/proc/self/clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
