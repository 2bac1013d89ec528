"""Benchmark scripts run end to end with a tiny budget (numbers are not asserted: they come
from the scripts' own runs on the real model; see the README)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run(args, tmp_path):
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, *args, "--json", str(out)], cwd=ROOT, check=True, timeout=600, capture_output=True)
    return json.loads(out.read_text())


def test_shared_forward_benchmark(tmp_path, tiny_path):
    r = _run(["benchmarks/shared_forward.py", "--model", "tiny-random", "--rows", "12", "--repeats", "1"], tmp_path)
    assert r["rows"] == 12 and r["max_grad_rel_diff"] < 1e-3 and r["speedup"] > 0


def test_pipeline_pace_benchmark(tmp_path, tiny_path):
    r = _run(["benchmarks/pipeline_pace.py", "--model", "tiny-random", "--steps", "1", "--warmup", "0",
              "--groups", "1", "--group_size", "2", "--backends", "single,local,ray"], tmp_path)
    assert set(r["results"]) == {"single", "local", "ray"}
    assert r["results"]["single"]["ratio"] == 1.0


def test_codec_benchmark(tmp_path):
    r = _run(["benchmarks/codec.py", "--number", "5", "--repeats", "1"], tmp_path)
    rows = {x["message"]: x for x in r["results"]}
    assert [x["arrays"] for x in rows.values()] == [1, 16, 256]  # the script checked every round trip
    assert all(x[k] > 0 for x in rows.values() for k in ("encode_us", "decode_us", "encode_vs_pickle", "decode_vs_pickle"))
