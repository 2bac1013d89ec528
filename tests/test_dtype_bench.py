"""benchmarks/dtype.py: a smoke run on the tiny model through the real path (``opentinker run``
of the bundled job once in each type), whose ratios follow from its own rows."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import check_provenance

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.slow
def test_dtype_runs_the_job_in_each_type_and_reports_ratios_of_its_rows(tmp_path, tiny_path) -> None:
    js = tmp_path / "dtype.json"
    res = subprocess.run([sys.executable, "benchmarks/dtype.py", "--quick", "--out", str(tmp_path / "o"),
                          "--json", str(js)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(js.read_text())
    check_provenance(r, "dtype.py")
    assert isinstance(r["provenance"]["cpu_bf16"], list)
    by = {row["dtype"]: row for row in r["rows"]}
    assert set(by) == {"float32", "bfloat16"} and all(row["seed"] == 0 and row["steps"] == 2 for row in r["rows"])
    for dtype, row in by.items():  # each run really ran in its type
        assert tomllib.loads((Path(row["run"]) / "config.toml").read_text())["model"]["dtype"] == dtype
        assert [c["step"] for c in row["curve"]] == [0, 2]
    for k in ("s_per_step", "learn_s", "wall_s"):
        assert r["ratios"][k]["mean"] == pytest.approx(by["float32"][k] / by["bfloat16"][k]), k
    assert r["ratios"]["final_chips"]["mean"] == pytest.approx(
        by["bfloat16"]["final"]["chips"] - by["float32"]["final"]["chips"])
    assert set(r["kernel_floor"]) == {f"{d}/M{m}" for d in ("float32", "bfloat16") for m in (4, 64)}
    assert all(v["ms"] > 0 and v["gflops"] > 0 for v in r["kernel_floor"].values())


def test_a_bad_seed_list_is_refused_by_name() -> None:
    res = subprocess.run([sys.executable, "benchmarks/dtype.py", "--seeds", "0,x"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert res.returncode != 0 and "--seeds / --rows: comma-separated integers" in res.stderr
