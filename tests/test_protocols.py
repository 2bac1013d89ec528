import msgspec
import numpy as np
import pytest

from protocols import PROTOCOL_VERSION, DecodeError, decode, encode
from protocols.codec import Header
from protocols.messages import (
    Datum, EpisodeSpec, ErrorCode, ForwardBackward, ParseOutcome, PolicyKind, PolicyRef,
    SampleRequest, SamplingParams, StopReason, Trajectory, Turn,
)


def _frames(msg, rid=0):
    return [bytes(f) for f in encode(msg, rid)]


def test_round_trip_keeps_arrays_out_of_the_body():
    prompts = [np.arange(7, dtype=np.int32), np.arange(3, dtype=np.int32) + 100]
    msg = SampleRequest(adapter="a", prompts=prompts, params=SamplingParams(max_tokens=4, seed=3), client="r0")
    frames = _frames(msg, 42)
    assert len(frames) == 2 + 2  # header, body, one buffer per array
    assert frames[2] == prompts[0].tobytes()
    rid, out = decode(frames)
    assert rid == 42 and out.adapter == "a" and out.params.seed == 3
    np.testing.assert_array_equal(out.prompts[1], prompts[1])
    assert out.prompts[1].dtype == np.int32


def test_trajectory_and_datum_round_trip():
    turn = Turn(
        obs_tokens=np.array([1, 2], np.int32), sampled_tokens=np.array([3], np.int32),
        sampler_logprobs=np.array([-0.5], np.float32), policy=PolicyRef(kind=PolicyKind.ADAPTER, name="p", version=2),
        stop_reason=StopReason.STOP, parse=ParseOutcome.OK, reward=1.0,
    )
    traj = Trajectory(episode_id=5, group_id=1, seat="player_0", seed=9, policy="p", turns=[turn, turn], total_reward=1.0)
    _, out = decode(_frames(traj))
    assert out.turns[1].policy.version == 2 and out.turns[0].sampler_logprobs[0] == np.float32(-0.5)
    d = Datum(tokens=np.arange(4, dtype=np.int32), loss_inputs={"mask": np.array([0, 1, 1, 0], np.float32)})
    _, fb = decode(_frames(ForwardBackward(adapter="p", datums=[d], loss="ppo", normalizer=2.0)))
    np.testing.assert_array_equal(fb.datums[0].loss_inputs["mask"], [0, 1, 1, 0])


def test_episode_spec_is_frozen_and_typed():
    spec = EpisodeSpec(episode_id=1, group_id=0, game="kuhn_poker_v0", seed=3, seats={"player_0": PolicyRef(kind=PolicyKind.BASE)})
    with pytest.raises(AttributeError):
        spec.seed = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "frames, code",
    [
        ([b"\x00"], ErrorCode.BAD_FRAME),
        ([b"garbage", b"x"], ErrorCode.BAD_FRAME),
        ([msgspec.msgpack.encode(Header(PROTOCOL_VERSION + 1, 7, 0)), b"\x80"], ErrorCode.BAD_VERSION),
        ([msgspec.msgpack.encode(Header(PROTOCOL_VERSION, 7, 0)), msgspec.msgpack.encode({"type": "Nope"})], ErrorCode.UNKNOWN_TYPE),
        ([msgspec.msgpack.encode(Header(PROTOCOL_VERSION, 7, 0)), msgspec.msgpack.encode({"type": "OptimStep", "adapter": 3, "params": {}})], ErrorCode.BAD_MESSAGE),
    ],
)
def test_bad_frames_raise_typed_errors(frames, code):
    with pytest.raises(DecodeError) as e:
        decode(frames)
    assert e.value.code is code


def test_array_buffer_size_and_message_size_are_checked():
    frames = _frames(SampleRequest(adapter=None, prompts=[np.arange(8, dtype=np.int32)], params=SamplingParams()))
    with pytest.raises(DecodeError, match="holds 4 bytes"):
        decode(frames[:2] + [frames[2][:4]])
    with pytest.raises(DecodeError) as e:
        decode(frames, max_bytes=16)
    assert e.value.code is ErrorCode.TOO_LARGE and e.value.request_id == 0


def test_schema_and_protocol_doc_are_current():
    """``docs/protocol.md``'s tables and ``docs/protocol.schema.json`` are what
    ``python -m protocols.schema`` writes today (regenerate them when a message changes)."""
    import json
    from pathlib import Path

    from protocols import schema as sch

    root = Path(__file__).resolve().parent.parent
    current = sch.schema()
    doc = (root / "docs/protocol.md").read_text()
    assert sch.render_doc(doc, current) == doc, "docs/protocol.md is stale: run python -m protocols.schema --doc docs/protocol.md"
    on_disk = json.loads((root / "docs/protocol.schema.json").read_text())
    assert on_disk == json.loads(json.dumps(current)), "docs/protocol.schema.json is stale: run python -m protocols.schema --json docs/protocol.schema.json"
    # Every message is a request, a reply, one-way, or the error; arrays are ArrayRefs.
    import typing

    from protocols import messages as m

    covered = set(sch.REPLIES) | set(sch.REPLIES.values()) | set(sch.ONE_WAY) | set(sch.PARTIAL_OF) | {m.Error}
    assert set(typing.get_args(m.Message)) == covered
    assert set(sch.PARTIAL_OF) == set(m.PARTIALS)
    assert current["$defs"]["LogprobsResult"]["properties"]["logprobs"]["items"] == {"$ref": "#/$defs/ArrayRef"}
    assert "`prompts` | list[array] | required | One ``int32[T]`` token array per row." in doc


def test_byte_swapped_strided_and_multidimensional_arrays_arrive_as_they_were_sent():
    big_endian = np.array([1.5, -2.25, 3e6], dtype=">f4")  # was sent as raw big-endian bytes and misread
    strided = np.arange(12, dtype=np.int64)[::3]
    grid = np.arange(6, dtype=np.float16).reshape(2, 3)
    d = Datum(tokens=strided.astype(np.int32), loss_inputs={"a": big_endian, "b": strided, "c": grid})
    _, out = decode(_frames(ForwardBackward(adapter="p", datums=[d], loss="ppo", normalizer=1.0)))
    li = out.datums[0].loss_inputs
    assert li["a"].tolist() == [1.5, -2.25, 3e6] and li["a"].dtype == np.dtype("<f4")  # the wire is little-endian
    assert li["b"].tolist() == [0, 3, 6, 9] and li["c"].shape == (2, 3) and li["c"].tolist() == grid.tolist()
    with pytest.raises(TypeError, match="complex64 is not allowed"):
        encode(ForwardBackward(adapter="p", datums=[Datum(tokens=np.zeros(1, np.int32),
                               loss_inputs={"x": np.zeros(2, np.complex64)})], loss="ppo", normalizer=1.0))


@pytest.mark.parametrize("ref, what", [
    (["float32", [2], 0, 1], "an array reference is"), (["complex64", [1], 0], "not allowed"),
    (["float32", [1], 5], "out of range"), (["float32", [-1], 0], "list of sizes"),
    (["float32", [True], 0], "list of sizes"), (["float32", [3], 0], "needs 12"),
])
def test_bad_array_references_are_bad_messages(ref, what):
    body = msgspec.msgpack.encode({"type": "LogprobsResult", "logprobs": [ref], "adapter_version": 0})
    with pytest.raises(DecodeError, match=what) as e:
        decode([msgspec.msgpack.encode(Header(PROTOCOL_VERSION, 7, 1)), body, np.zeros(1, np.float32).tobytes()])
    assert e.value.code is ErrorCode.BAD_MESSAGE and e.value.request_id == 7
