"""``opentinker infer``: batch inference on the tiny-random model, its replies the scheduler's
own sampling (same seeds, same tokens and log-probs), whatever the batching; bad input is one
line naming what is wrong, and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from conftest import DEVICE

from opentinker.cli import main

PROMPTS = [
    {"id": "greet", "messages": [{"role": "user", "content": "Say hello."}]},
    {"prompt": "Once upon a time"},
    {"id": 7, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3."}]},
    {"prompt": "The capital of France is"},
    {"id": "last", "prompt": "1, 2, 3,"},
]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_path):
    """An adapter moved off the base model by one update, saved, and the scheduler's own replies
    with it to each of :data:`PROMPTS` (line ``i`` alone, seed ``5 + i``)."""
    from opentinker.bus import SyncClient
    from opentinker.config import JobConfig
    from opentinker.control.runtime import Job
    from opentinker.rollout.render import ChatTokenizer
    from protocols.messages import (
        AdamParams,
        CreateAdapter,
        Datum,
        ForwardBackward,
        LoraSpec,
        OptimStep,
        SampleRequest,
        SamplingParams,
        SaveAdapter,
    )

    root = tmp_path_factory.mktemp("infer")
    tok = ChatTokenizer(tiny_path)
    tokens = [np.asarray(tok.encode(tok.render(p["messages"], add_generation_prompt=True) if "messages" in p
                                    else p["prompt"]), np.int32) for p in PROMPTS]
    cfg = msgspec.convert({"out_dir": str(root), "runtime": {"backend": "local"},
                           "model": {"base": "tiny-random", "threads": 1, "device": DEVICE}}, JobConfig)
    job = Job(cfg, tiny_path, run_dir=str(root.resolve()), scheduler_only=True)
    try:
        with SyncClient(job.scheduler_endpoint, "test") as client:
            client.request(CreateAdapter(name="pol", spec=LoraSpec(rank=4, seed=3)))
            seq = np.arange(10, 40, dtype=np.int32)
            mask = np.r_[np.zeros(10), np.ones(20)].astype(np.float32)
            client.request(ForwardBackward(adapter="pol", datums=[Datum(tokens=seq, loss_inputs={"mask": mask})],
                                           loss="sft", normalizer=20.0))
            client.request(OptimStep(adapter="pol", params=AdamParams(lr=0.5)))
            client.request(SaveAdapter(adapter="pol", path=str((root / "pol").resolve())))
            params = SamplingParams(max_tokens=6, stop_token_ids=(tok.eos_id,))
            direct = [client.request(SampleRequest(adapter="pol", prompts=[t], params=msgspec.structs.replace(
                params, seed=5 + i))) for i, t in enumerate(tokens)]
    finally:
        job.shutdown()
    return root / "pol", direct, tok.eos_id


def test_infer_replies_as_the_scheduler_samples(trained, tmp_path, capsys):
    adapter, direct, eos = trained
    prompts = _write(tmp_path / "prompts.jsonl", PROMPTS)

    def opts(seed: str = "5") -> list[str]:
        return ["--model", "tiny-random", "--max-tokens", "6", "--seed", seed, "--threads", "1", "--device", DEVICE]

    outs = {}
    for batch in ("2", "5"):
        outs[batch] = tmp_path / f"out_{batch}.jsonl"
        assert main(["infer", str(prompts), "--out", str(outs[batch]), "--adapter", str(adapter), "--batch", batch,
                     *opts()]) == 0
    assert "wrote" in capsys.readouterr().out
    rows, one_batch = _read(outs["2"]), _read(outs["5"])
    for a, b in zip(rows, one_batch, strict=True):  # a line's reply does not depend on its batch
        assert {k: v for k, v in a.items() if k != "logprobs"} == {k: v for k, v in b.items() if k != "logprobs"}
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)  # batched with other rows: float rounding
    assert [r["id"] for r in rows] == ["greet", 2, 7, 4, "last"]  # the file's order; the line number by default
    for row, want in zip(rows, direct):
        drawn = want.tokens[0].tolist()
        kept = drawn[:drawn.index(eos)] if eos in drawn else drawn  # the eos ends a reply, not kept
        assert row["tokens"] == kept
        assert row["logprobs"] == pytest.approx(want.logprobs[0][:len(kept)].tolist(), abs=1e-5)
        assert row["finish_reason"] == ("stop" if eos in drawn else "length")
        assert (row["model"], row["adapter_version"]) == ("pol", 1)
    base = tmp_path / "base.jsonl"
    assert main(["infer", str(prompts), "--out", str(base), *opts()]) == 0
    base_rows = _read(base)
    assert {(r["model"], r["adapter_version"]) for r in base_rows} == {("base", -1)}
    assert [r["tokens"] for r in base_rows] != [r["tokens"] for r in rows]  # the adapter was used
    greedy = tmp_path / "greedy.jsonl"
    assert main(["infer", str(prompts), "--out", str(greedy), "--temperature", "0", *opts()]) == 0
    again = tmp_path / "greedy_again.jsonl"
    assert main(["infer", str(prompts), "--out", str(again), "--temperature", "0", *opts(seed="9")]) == 0
    assert [r["tokens"] for r in _read(greedy)] == [r["tokens"] for r in _read(again)]  # greedy: seeds do not matter


@pytest.mark.parametrize(("lines", "args", "said"), [
    ([PROMPTS[0], "{not json"], [], "line 2: not JSON"),
    ([{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}], [], "line 2: id 1 is not a string or an integer, or is "
                                                                 "not unique"),
    ([{"prompt": "a", "messages": []}], [], 'line 1: an object with "messages" (a chat) or "prompt" (a text), one '
                                            "of the two"),
    ([{"messages": [{"role": "user"}]}], [], 'line 1: "messages" must be a non-empty list of {"role": str, '
                                            '"content": str}'),
    ([{"prompt": "x " * 5000}], [], "line 1: the prompt is"),
    ([], [], "no prompts"),
    ([PROMPTS[1]], ["--max-tokens", "0"], "--max-tokens: between 1 and 4096, got 0"),
    ([PROMPTS[1]], ["--adapter", "/nonexistent"], "--adapter /nonexistent: no such file or folder"),
])
def test_infer_refuses_bad_input_and_writes_nothing(tmp_path, capsys, lines, args, said):
    prompts = _write(tmp_path / "prompts.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["infer", str(prompts), "--out", str(out), "--model", "tiny-random", "--threads", "1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opentinker infer: ") and said in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]  # nothing written


def test_infer_never_replaces_a_file(tmp_path, capsys):
    prompts = _write(tmp_path / "prompts.jsonl", PROMPTS[:1])
    out = tmp_path / "out.jsonl"
    out.write_text("keep me\n")
    assert main(["infer", str(prompts), "--out", str(out), "--model", "tiny-random"]) == 2
    assert "already exists (nothing is replaced)" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"


def test_a_line_may_hold_any_character(tiny_path, tmp_path):
    """A JSON string may hold U+2028, U+0085 and the like unescaped: the line stays one prompt."""
    from opentinker.rollout.render import ChatTokenizer
    from opentinker.serve.infer import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\x85c\x0bd"}, ensure_ascii=False) + "\n" + json.dumps(PROMPTS[0]) + "\n")
    prompts = read_prompts(str(path), ChatTokenizer(tiny_path), 100)
    assert [p.id for p in prompts] == [1, "greet"]
