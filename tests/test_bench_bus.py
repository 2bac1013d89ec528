"""The bus benchmark runs end to end with a tiny budget: every (kind, transport, payload) row is
there with positive numbers, the authenticated and encrypted rows included (the numbers
themselves come from the script's own full run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import check_provenance

ROOT = Path(__file__).resolve().parent.parent

KINDS = ("bus_sync", "bus_async", "bus_async_park", "bus_sync_curve", "raw_zmq", "raw_zmq_plain", "raw_zmq_curve", "ray")
TRANSPORTS = ("ipc", "tcp")
PAYLOADS = ("small", "1MiB")


@pytest.mark.slow
@pytest.mark.ray
def test_bus_benchmark(tmp_path):
    out = tmp_path / "bus.json"
    subprocess.run(
        [sys.executable, "benchmarks/bus.py", "--n", "50", "--n_large", "5", "--transports", ",".join(TRANSPORTS),
         "--kinds", ",".join(KINDS), "--connects", "3", "--json", str(out)],
        cwd=ROOT, check=True, timeout=300, capture_output=True,
    )
    report = json.loads(out.read_text())
    check_provenance(report, "bus.py")
    rows = report["results"]
    got = {(r["kind"], r["transport"], r["payload"]): r for r in rows}
    want = {(k, t, p) for k in KINDS if k != "ray" for t in TRANSPORTS for p in PAYLOADS}
    want |= {("ray", "ray", p) for p in PAYLOADS}
    assert set(got) == want and len(rows) == len(want)
    for key, r in got.items():
        assert r["n"] == (50 if key[2] == "small" else 5), key
        for field in ("bytes", "p50_us", "p99_us", "cpu_us", "msgs_per_s", "mib_per_s", "vs_raw_zmq", "throughput_vs_raw_zmq", "ray_p50_over_this"):
            assert r[field] is not None and r[field] > 0, (key, field, r[field])
        assert r["p99_us"] >= r["p50_us"], key
        timed = key[2] == "small" and (key[0].startswith("raw") or key[0].startswith("bus_sync"))
        assert (r["connect_us"] is not None and r["connect_us"] > 0) if timed else r["connect_us"] is None, key
    mechanisms = {k: r["mechanism"] for (k, _, _), r in got.items()}
    assert mechanisms == {"bus_sync": "plain", "bus_async": "plain", "bus_async_park": "plain", "bus_sync_curve": "curve",
                          "raw_zmq": "null", "raw_zmq_plain": "plain", "raw_zmq_curve": "curve", "ray": "ray"}
    # The ratios the table prints are those of the rows' own latencies (Ray's over TCP's raw ZeroMQ).
    for (k, t, p), r in got.items():
        raw = got[("raw_zmq", "tcp" if t == "ray" else t, p)]
        assert r["vs_raw_zmq"] == pytest.approx(r["p50_us"] / raw["p50_us"]), (k, t, p)
        assert r["throughput_vs_raw_zmq"] == pytest.approx(raw["msgs_per_s"] / r["msgs_per_s"]), (k, t, p)
        assert r["ray_p50_over_this"] == pytest.approx(got[("ray", "ray", p)]["p50_us"] / r["p50_us"]), (k, t, p)
    assert got[("bus_async", "tcp", "1MiB")]["bytes"] > 1 << 20
