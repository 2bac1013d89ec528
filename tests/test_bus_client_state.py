"""The client state machine under both bus clients (``opentinker/bus/client_state.py``),
driven without sockets: events in (frames as a server would send them, heartbeat ticks, a
clock value), and the frames it says to send, the requests it answers and the errors it
raises checked. No clock is read and nothing waits."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from opentinker.bus import PeerLost, ProtocolMismatch, RemoteError
from opentinker.bus.client_state import ClientState, Received, Send, StateClient
from opentinker.bus.common import REPLY_LIMITS, PartialCallbackFailed
from opentinker.bus.frames import Cut
from protocols.codec import decode, encode
from protocols.messages import (
    PROTOCOL_VERSION,
    Ack,
    AdamParams,
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    OptimStep,
    OptimStepResult,
    SampleChunk,
    Welcome,
)


def state(heartbeat_s: float | None = 3.0, spin_s: float = 1e-3) -> ClientState:
    return ClientState("me", "tcp://127.0.0.1:5", REPLY_LIMITS, heartbeat_s, spin_s)


def wire(msg, rid: int) -> list[zmq.Frame]:
    """``msg`` with request id ``rid`` as the client's socket would read it."""
    return [zmq.Frame(bytes(b)) for b in encode(msg, rid)]


def sent(send: Send):
    """``(request id, message)`` of frames the state said to send."""
    return decode([bytes(b) for b in send.frames])


def step(name: str = "a") -> OptimStep:
    return OptimStep(adapter=name, params=AdamParams())


def result(version: int) -> OptimStepResult:
    return OptimStepResult(version=version, grad_norm=0.5)


def chunk(seq: int) -> SampleChunk:
    return SampleChunk(rows=[0], tokens=[np.array([seq], np.int32)], logprobs=[np.array([-1.0], np.float32)], seq=seq)


def welcomed(s: ClientState) -> None:
    rid, _ = s.hello()
    assert s.receive(wire(Welcome(version=PROTOCOL_VERSION, peer="srv"), rid), None, 0.0).rid == rid
    s.welcomed(s.take(rid))
    s.forget(rid)


def test_hello_then_welcome_starts_the_session_and_keeps_nothing_of_the_hello():
    s = state()
    rid, hello = s.hello()
    assert sent(hello) == (rid, Hello(version=PROTOCOL_VERSION, peer="me")) and hello.what == "request"
    assert s.outstanding == {rid: Hello(version=PROTOCOL_VERSION, peer="me")} and s.counters["sent/Hello"] == 1
    assert s.welcome is None
    got = s.receive(wire(Welcome(version=PROTOCOL_VERSION, peer="srv", heartbeat_s=3.0), rid), None, 0.0)
    assert got == Received(rid, Welcome(version=PROTOCOL_VERSION, peer="srv", heartbeat_s=3.0))
    assert s.welcomed(s.take(rid)).peer == "srv" and s.welcome is not None
    s.forget(rid)
    assert s.outstanding == {} and s.replies == {} and s.sent_at == {} and s.counters["recv/Welcome"] == 1


@pytest.mark.parametrize("answer, error", [
    (Error(code=ErrorCode.BAD_VERSION, message="speaks 9"), ProtocolMismatch),
    (Ack(), ProtocolMismatch),
    (Error(code=ErrorCode.BUSY, message="full"), RemoteError),
])
def test_a_hello_answered_otherwise_is_refused(answer, error):
    s = state()
    rid, _ = s.hello()
    s.receive(wire(answer, rid), None, 0.0)
    with pytest.raises(error, match="me -> tcp://127.0.0.1:5"):
        s.welcomed(s.take(rid))
    assert s.welcome is None


def test_each_reply_answers_its_own_request_and_only_the_first_counts():
    s = state()
    welcomed(s)
    a, b = 11, 12
    assert sent(s.request(step("a"), a)) == (a, step("a")) and sent(s.request(step("b"), b)) == (b, step("b"))
    assert s.counters["sent/OptimStep"] == 2
    assert s.receive(wire(result(2), b), None, 1.0) == Received(b, result(2))
    assert s.receive(wire(result(9), b), None, 1.0).rid is None  # a second answer: dropped
    assert s.receive(wire(Ack(), 99), None, 1.0).rid is None  # no such request
    assert s.replies == {b: result(2)} and a in s.outstanding
    assert s.result(step("b"), s.take(b)) == result(2)
    assert s.receive(wire(result(1), a), None, 1.0).rid == a
    assert s.take(a) == result(1) and s.counters["recv/OptimStepResult"] == 3
    for rid in (a, b):
        s.forget(rid)
    assert s.receive(wire(Ack(), a), None, 1.0).rid is None and s.replies == {}  # forgotten: dropped


def test_an_error_reply_is_raised_as_remote_error_naming_the_request():
    s = state()
    s.request(step(), 5)
    s.receive(wire(Error(code=ErrorCode.INVALID, message="no such adapter"), 5), None, 0.0)
    with pytest.raises(RemoteError, match=r"me -> tcp://127.0.0.1:5 \(OptimStep\): invalid: no such adapter"):
        s.result(step(), s.take(5))


def test_partials_go_to_their_callback_in_order_and_are_never_the_reply():
    s = state()
    got: list[int] = []
    s.request(step(), 7, on_partial=lambda m: got.append(m.seq))
    s.request(step(), 8)  # no callback
    for seq in range(3):
        assert s.receive(wire(chunk(seq), 7), None, 0.5).rid is None
    assert s.receive(wire(chunk(0), 8), None, 0.5).rid is None
    assert s.receive(wire(chunk(0), 404), None, 0.5).rid is None
    assert got == [0, 1, 2] and s.replies == {}
    assert s.counters["stream/ignored"] == 1 and s.counters["stream/unknown"] == 1
    assert s.receive(wire(Ack(), 7), None, 0.5) == Received(7, Ack())


def test_a_callback_that_raises_fails_its_request_and_cancels_it():
    s = state()

    def boom(m):
        raise KeyError("bad chunk")

    s.request(step(), 7, on_partial=boom)
    s.sent(7, 1.0)
    got = s.receive(wire(chunk(0), 7), None, 1.5)
    assert got.rid == 7 and got.cancel is True and s.counters["stream/callback_error"] == 1
    assert isinstance(s.replies[7], PartialCallbackFailed) and 7 not in s.on_partial and 7 not in s.sent_at
    assert s.receive(wire(Ack(), 7), None, 2.0).rid is None  # the failure stays the answer
    cancel = s.cancel(7)
    assert cancel.what == "cancel" and sent(cancel)[1] == Cancel(request_id=7) and s.counters["sent/Cancel"] == 1
    with pytest.raises(KeyError, match="bad chunk"):
        s.result(step(), s.take(7))
    assert s.polling.rtt == {}  # a failure is not a round trip


def test_round_trips_are_timed_from_the_send_or_from_when_the_caller_waited():
    s = state(spin_s=0.1)
    s.request(step(), 1)
    s.sent(1, 10.0)
    s.receive(wire(chunk(0), 1), None, 10.5)  # a partial is not the round trip
    assert s.polling.rtt == {}
    s.receive(wire(Ack(), 1), None, 10.25 + 0.5)
    assert s.polling.rtt[OptimStep] == pytest.approx(0.75) and not s.polling.worth_it(OptimStep)
    s.request(step(), 2)
    s.sent(2, 20.0)
    s.waiting_since = 20.7  # the caller came for it late
    s.receive(wire(Ack(), 2), None, 20.75)
    assert s.polling.rtt[OptimStep] == pytest.approx(0.75 + 0.2 * (0.05 - 0.75))
    assert s.sent_at == {}


def test_three_silent_intervals_lose_the_server_and_a_frame_resets_the_count():
    s = state()
    welcomed(s)
    for seq in (1, 2):
        beat = s.tick(float(seq))
        assert isinstance(beat, Send) and beat.what == "heartbeat" and sent(beat)[1] == Heartbeat(seq=seq)
    s.receive(wire(Heartbeat(seq=0), 123), None, 2.5)  # any frame is a sign of life
    assert s.beats.missed == 0
    assert isinstance(s.tick(3.0), Send) and isinstance(s.tick(4.0), Send)
    lost = s.tick(5.0)
    assert isinstance(lost, PeerLost) and str(lost) == "me: nothing from tcp://127.0.0.1:5 in 3 heartbeats"
    assert s.welcome is None and s.counters["peer_lost"] == 1 and s.counters["sent/Heartbeat"] == 4
    assert s.beats.missed == 0 and isinstance(s.tick(6.0), Send)  # counting starts over


def test_a_heartbeat_is_due_after_an_interval_without_a_send():
    s = state(heartbeat_s=3.0)
    s.request(step(), 1)
    s.sent(1, 10.0)
    assert not s.beat_due(12.9) and s.beat_due(13.0)
    s.beat(13.0)
    assert not s.beat_due(15.9) and s.beat_due(16.0)
    assert not state(heartbeat_s=None).beat_due(1e9)


def test_no_handshake_is_retried_once_after_a_new_hello():
    s = state()
    welcomed(s)
    no_handshake = Error(code=ErrorCode.NO_HANDSHAKE, message="say Hello")
    assert s.retry(no_handshake, 0) is True and s.welcome is None
    welcomed(s)
    assert s.retry(no_handshake, 1) is False and s.welcome is not None
    assert s.retry(Error(code=ErrorCode.BUSY, message="full"), 0) is False
    assert s.retry(Ack(), 0) is False


def test_a_reply_over_the_limits_answers_its_request_with_too_large():
    s = state()
    s.request(step(), 42)
    header = wire(Ack(), 42)[:1]
    got = s.receive(header, Cut("frames", 5000, 1 << 20), 0.0)
    assert got.rid == 42 and isinstance(got.message, Error) and got.message.code is ErrorCode.TOO_LARGE
    assert s.counters["dropped/too_many_frames"] == 1 and s.counters["dropped/bytes"] == 1 << 20
    with pytest.raises(RemoteError, match="too_large"):
        s.result(step(), s.take(42))


def test_a_client_shows_its_state():
    c = StateClient("me", "inproc://x", None, 0.0, None, 1234)
    assert (c.name, c.endpoint, c.heartbeat_s, c.max_bytes) == ("me", "inproc://x", None, 1234)
    assert c.limits.max_buffers == REPLY_LIMITS.max_buffers and c.welcome is None
    c.state.request(step(), 3, on_partial=print)
    assert c._on_partial == {3: print} and c.counters is c.state.counters and c.polling is c.state.polling
    assert c.beats is c.state.beats and c.next_request_id() != c.next_request_id()
    with pytest.raises(ValueError, match="spin_s"):
        StateClient("me", "inproc://x", None, -1.0, None, None)
