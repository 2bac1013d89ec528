"""Benchmark scripts run end to end with a tiny budget (numbers are not asserted: they come
from the scripts' own runs on the real model; see the README)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import check_provenance

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run(args, tmp_path):
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, *args, "--json", str(out)], cwd=ROOT, check=True, timeout=600, capture_output=True)
    return json.loads(out.read_text())


def test_shared_forward_benchmark(tmp_path, tiny_path):
    r = _run(["benchmarks/shared_forward.py", "--model", "tiny-random", "--rows", "12", "--groups", "2",
              "--repeats", "1"], tmp_path)
    check_provenance(r, "shared_forward.py")
    kuhn, ttt = r["batches"]
    assert (kuhn["batch"], kuhn["rows"], ttt["batch"], ttt["rows"]) == ("kuhn", 12, "tictactoe", 8)
    for b in (kuhn, ttt):
        assert list(b["methods"]) == ["plain", "levels", "tree"]
        for m in b["methods"].values():  # every method's gradients are the plain batch's
            assert m["max_grad_rel_diff"] < 1e-3
            assert m["speedup"] == pytest.approx(b["methods"]["plain"]["median_s"] / m["median_s"])
    # episodes of a group share their start and some of their turns: the tree computes under half the tokens
    assert 0 < ttt["tree_tokens"] < ttt["tokens"] / 2


def test_exploring_replies_benchmark(tmp_path, tiny_path):
    r = _run(["benchmarks/exploring_replies.py", "--model", "tiny-random", "--groups", "2", "--group_size", "2",
              "--threads", "1"], tmp_path)
    check_provenance(r, "exploring_replies.py")
    res = r["result"]
    assert list(res["ways"]) == ["dense", "forced", "forced_turn"] and res["max_logprob_diff"] < 1e-4
    assert res["replies"] >= 4 * 3 and res["turns"] >= 3  # every episode's seat replies at least three times
    dense, forced = res["ways"]["dense"], res["ways"]["forced"]
    # the forced rows find their earlier turns cached: they compute well under half the dense tokens
    assert 0 < forced["tokens_computed"] < dense["tokens_computed"] / 2
    for w in res["ways"].values():
        assert w["speedup"] == pytest.approx(dense["total_s"] / w["total_s"])


PHASES = ("median_s", "rollout_s", "learn_s", "compute_s", "comm_s", "eval_s", "cpu_total_s", "cpu_util")


def _pace(tmp_path, backends):
    return _run(["benchmarks/pipeline_pace.py", "--model", "tiny-random", "--steps", "1", "--warmup", "0",
                 "--groups", "1", "--group_size", "2", "--eval_hands_per_stratum", "1", "--backends", backends], tmp_path)


def test_pipeline_pace_benchmark(tmp_path, tiny_path):
    r = _pace(tmp_path, "single,local")
    check_provenance(r, "pipeline_pace.py")
    assert set(r["results"]) == {"single", "local"} and r["args"]["eval_hands_per_stratum"] == 1
    base = r["results"]["single"]["median_s"]  # every ratio (the README's) is its row's median over the baseline's
    assert all(x["ratio"] == pytest.approx(x["median_s"] / base) for x in r["results"].values())
    for backend, x in r["results"].items():
        assert all(x[k] > 0 for k in PHASES), (backend, x)
        assert x["compute_s"] <= x["median_s"] and x["rollout_s"] + x["learn_s"] <= x["median_s"]
        # one process holds the model (and, on local, every component): it used CPU
        (kind,) = x["cpu_s"]
        assert kind.startswith("driver+") and ("scheduler" in kind or "model_host" in kind), kind
        assert x["cpu_s"][kind] > 0 and x["processes"] == {kind: 1}


def test_pipeline_pace_benchmark_ray(tmp_path, tiny_path):
    x = _pace(tmp_path, "ray")["results"]["ray"]
    assert all(x[k] > 0 for k in PHASES), x
    assert {"driver", "scheduler", "env_runner", "learner", "coordinator", "raylet", "gcs_server"} <= set(x["cpu_s"])
    assert x["cpu_s"]["scheduler"] > 0 and x["processes"]["env_runner"] == 2


def test_codec_benchmark(tmp_path):
    r = _run(["benchmarks/codec.py", "--number", "5", "--repeats", "1"], tmp_path)
    check_provenance(r, "codec.py")
    rows = {x["message"]: x for x in r["results"]}
    assert [x["arrays"] for x in rows.values()] == [1, 16, 256]  # the script checked every round trip
    assert all(x[k] > 0 for x in rows.values() for k in ("encode_us", "decode_us", "encode_vs_pickle", "decode_vs_pickle"))


def test_multiplex_benchmark(tmp_path, tiny_path):
    r = _run(["benchmarks/multiplex.py", "--quick", "--phases", "decode,floor,train", "--peft_row", "4,8,4",
              "--profile_steps", "2", "--train_seqs", "2", "--train_len", "16", "--target_tps", "4x8:1,4x64:1"],
             tmp_path)
    check_provenance(r, "multiplex.py")
    assert r["provenance"]["torch_threads"] >= 1 and r["provenance"]["mm_gflops_per_s"] > 0
    assert r["machine"]["cpu_capability"] and r["args"]["phases"] == "decode,floor,train"
    decode = {(x["method"], x["K"], x["batch"]): x for x in r["rows"] if x["phase"] == "decode"}
    methods = ("engine", "swap", "copies")
    # PEFT's mixed batch only at --peft_row (there the engine row of the grid is its baseline).
    assert set(decode) == {(m, k, 8) for m in methods for k in (1, 4)} | {("peft_mixed", 4, 8)}
    for x in decode.values():
        assert "error" not in x, x
        assert x["generated_tokens"] == 8 * 4 and x["prompt_tokens"] == 8 * 16  # no early stop
        assert x["tokens_per_s"] > 0 and x["peak_bytes"] > x["rss_before_model_bytes"] > 0
    for k in (1, 4):
        eng, cop = decode["engine", k, 8], decode["copies", k, 8]
        assert len({decode[m, k, 8]["flops"] for m in methods}) == 1  # one FLOP estimate for the same work
        assert cop["weights_bytes"] == k * eng["weights_bytes"] and cop["kv_pool_bytes"] == k * eng["kv_pool_bytes"]
        assert eng["adapter_bytes"] == cop["adapter_bytes"]
        # KV is reserved per row (prompt + max_tokens): the same however rows are split over adapters or copies
        assert 0 < eng["kv_peak_bytes"] == cop["kv_peak_bytes"] == decode["engine", 1, 8]["kv_peak_bytes"]
        # The engine rows' steady decode step: profiled, every row decoding, compared with the floor.
        assert eng["decode_tokens_per_s"] == pytest.approx(8 / eng["decode_step_ms"] * 1000)
        assert eng["ops"] > 0 and eng["vs_floor"] > 0
    assert decode["engine", 4, 8]["adapter_bytes"] == 4 * decode["engine", 1, 8]["adapter_bytes"]
    assert decode["engine", 4, 8]["adapter_bytes"] == decode["peft_mixed", 4, 8]["adapter_bytes"]
    assert decode["engine", 4, 8]["vs_peft_mixed"] == pytest.approx(
        decode["engine", 4, 8]["tokens_per_s"] / decode["peft_mixed", 4, 8]["tokens_per_s"])
    (floor,) = [x for x in r["rows"] if x["phase"] == "floor"]
    # tiny-random: 2 layers x 7 projections + the tied vocabulary projection.
    assert floor["batch"] == 8 and floor["matmuls"] == 15 and floor["decode_tokens_per_s"] > 0
    train = {x["method"]: x for x in r["rows"] if x["phase"] == "train"}
    assert set(train) == {"train_lora", "train_full"}
    for x in train.values():
        assert x["tokens"] == 32 and x["loss_tokens"] == 16 and x["tokens_per_s"] > 0 and x["peak_bytes"] > 0
    # The full copy trains every base weight; the adapter its LoRA matrices only.
    assert train["train_full"]["trainable_params"] > 100 * train["train_lora"]["trainable_params"]
    assert train["train_full"]["trainable_params"] * 4 >= train["train_full"]["weights_bytes"]
    # Targets: stated, and a missing row reported as not met rather than left out.
    by = {t["what"]: t for t in r["targets"]}
    assert by["decode tokens/s, 4 adapters at batch 8"]["met"] is True
    assert by["decode tokens/s, 4 adapters at batch 64"] == {
        "what": "decode tokens/s, 4 adapters at batch 64", "target": 1.0, "got": None, "met": False}
    assert "4 adapters / 1 adapter at batch 8" in by


def test_rollout_benchmark(tmp_path, tiny_path):
    from opentinker.config import load_config
    from opentinker.rollout.episodes import game_agents, train_episodes
    from protocols.messages import PolicyKind

    r = _run(["benchmarks/rollout.py", "--quick", "--threads", "1"], tmp_path)
    check_provenance(r, "rollout.py")
    games = ["kuhn_poker_v0", "negotiation_v0"]
    assert [(x["path"], x["game"]) for x in r["rows"]] == [(p, g) for g in games for p in ("before", "engine")]
    # --quick: 1 step of 2 groups x 2 episodes. Every episode's first mover (player_0) plays;
    # the other LLM seats may not (a tiny-random reply can end the game: a forfeit).
    seats = {}
    for job, game in zip(("default", "negotiation"), games):
        cfg = load_config(job, {"model": {"base": "tiny-random"}, "train": {"groups_per_step": 2, "group_size": 2}})
        specs = train_episodes(cfg, 1)
        first = game_agents(cfg.game)[0]
        seats[game] = (sum(s.seats[first].kind is not PolicyKind.SCRIPTED for s in specs),
                       sum(ref.kind is not PolicyKind.SCRIPTED for s in specs for ref in s.seats.values()))
    for x in r["rows"]:
        assert x["steps"] == 1 and len(x["step_s"]) == 1 and x["episodes"] == 4
        lo, hi = seats[x["game"]]
        assert 0 < lo <= x["llm_seats"] <= hi and x["llm_turns"] >= x["llm_seats"]
        assert 0 < x["new_tokens"] <= x["prompt_tokens"] and 0 < x["prefill_tokens"] <= x["prompt_tokens"]
        for k in ("s_per_step", "prefill_tokens_per_turn", "new_tokens_per_turn", "prefill_over_new", "speedup"):
            assert isinstance(x[k], float), k
        if x["path"] == "engine":  # the engine's own counters agree with the prompts and replies played
            e = x["engine_stats"]
            assert e["prompt_tokens"] == x["prompt_tokens"] == e["prefill_tokens"] + e["cached_tokens"] + e["twin_tokens"]
            assert e["decode_tokens"] == x["reply_tokens"] and e["prefill_tokens"] == x["prefill_tokens"]
        else:
            assert x["prefill_tokens"] <= x["padded_prefill_tokens"]


def test_engine_overhead_benchmark(tmp_path, tiny_path):
    r = _run(["benchmarks/engine_overhead.py", "--quick"], tmp_path)
    check_provenance(r, "engine_overhead.py")
    rows = {(x["method"], x["batch"], x["adapters"]): x for x in r["rows"]}
    assert set(rows) == {(m, b, k) for m in ("slots", "bgmv") for b in (4, 64) for k in (1, 16)}
    fused = {x["ops"] for (m, _, _), x in rows.items() if m == "slots"}
    assert len(fused) == 1  # one decode step's ops: the same for every batch and adapter count
    assert all(x["aten_ops"] >= x["ops"] > 0 and x["step_ms"] > 0 for x in rows.values())
    assert all(x["decode_tokens_per_s"] == pytest.approx(x["batch"] / x["step_ms"] * 1000) for x in rows.values())
    for (m, b, k), x in rows.items():  # each row's ratio is to the bgmv row of its batch and adapters
        assert x["speedup_vs_bgmv"] == pytest.approx(rows["bgmv", b, k]["step_ms"] / x["step_ms"])


def test_train_memory_benchmark(tmp_path, tiny_path):
    r = _run(["benchmarks/train_memory.py", "--quick"], tmp_path)
    check_provenance(r, "train_memory.py")
    rows = {(x["groups"], x["turns"], x["budget"]): x for x in r["rows"]}
    assert set(rows) == {(2, 2, "0"), (2, 2, "auto"), (4, 2, "auto")}
    for x in rows.values():
        assert "error" not in x, x
        assert x["step_peak_bytes"] > 0 and x["datums"] == 4 * x["groups"] and np.isfinite(x["loss"])
    # Bounded or not, the same step: the same loss and gradient.
    assert rows[2, 2, "auto"]["grad_rel_diff"] < 1e-5 and rows[2, 2, "auto"]["loss"] == pytest.approx(
        rows[2, 2, "0"]["loss"], rel=1e-5)


def test_hostile_load_benchmark(tmp_path, tiny_path):
    r = _run(["benchmarks/hostile_load.py", "--quick"], tmp_path)
    check_provenance(r, "hostile_load.py")
    assert r["huge_status"] == {"declared": 413, "chunked": 413} and r["small_status"] == 200
    assert r["flood_200"] + r["flood_429"] == r["args"]["flood"]
    assert r["small_baseline_s_median"] > 0 and r["rss_peak_growth_mb"] >= 0
