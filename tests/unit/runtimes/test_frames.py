"""The worker↔runtime frames (`runtimes.wire.frames`) through the length-prefixed protocol: each
decodes, on the connection it travels, into the frame sent."""

from __future__ import annotations

import socket

import pytest

from runtimes.wire import frames, protocol

BATCH_REQUESTS = [
    frames.Run("m", [frames.RunRequest("a", "encode", {"items": [{"text": "x"}]}),
                     frames.RunRequest("b", "generate", {"prompt": "y"}, stream=True)],
               deltas=True),
    frames.Run("m", [frames.RunRequest("c", "encode", ["not", "a", "map"])]),  # checked later
    frames.Probe("m"),
    frames.Ping(),
]
CONTROL_REQUESTS = [frames.Load("m"), frames.Load("m", "style"), frames.Unload("m", "style"),
                    frames.Ping(), frames.Cancel(["a", "b"])]
BATCH_REPLIES = [
    frames.Ready(123, {"m": 1024}, None),
    frames.Outcomes([frames.RunOutcome("a", {"embedding": [0.5, 1.0]}, stats={"tokens": 3}),
                     frames.RunOutcome("b", None, "VALIDATION_ERROR", "bad")]),
    frames.Failed("RuntimeError('CUDA error')", fatal=True),
    frames.Deltas([frames.StreamDelta("b", 0, "hel", 1)]),
    frames.Pong(123),
    frames.Rejected("unknown"),
]
CONTROL_REPLIES = [frames.Loaded("m", 2048, 0.25), frames.Unloaded("m"),
                   frames.Failed("OSError('gone')"), frames.Pong(1), frames.Rejected("x")]


@pytest.mark.parametrize("sent,decoder", [
    *((f, frames.BATCH_REQUEST_DECODER) for f in BATCH_REQUESTS),
    *((f, frames.CONTROL_REQUEST_DECODER) for f in CONTROL_REQUESTS),
    *((f, frames.BATCH_REPLY_DECODER) for f in BATCH_REPLIES),
    *((f, frames.CONTROL_REPLY_DECODER) for f in CONTROL_REPLIES),
    (frames.Cancel(["a"]), frames.CANCEL_DECODER),
])
def test_each_frame_arrives_as_sent(sent, decoder):
    a, b = socket.socketpair()
    with a, b:
        protocol.send_frame(a, sent)
        assert protocol.recv_frame(b, decoder) == sent


def test_a_frame_of_another_connection_is_malformed_and_the_stream_stays_in_step():
    a, b = socket.socketpair()
    with a, b:
        protocol.send_frame(a, frames.Load("m"))
        protocol.send_frame(a, frames.Ping())
        with pytest.raises(protocol.MalformedFrame, match="Invalid value 'load'"):
            protocol.recv_frame(b, frames.BATCH_REQUEST_DECODER)
        assert protocol.recv_frame(b, frames.BATCH_REQUEST_DECODER) == frames.Ping()


def test_a_delta_is_an_array_on_the_wire():
    a, b = socket.socketpair()
    with a, b:
        protocol.send_frame(a, frames.Deltas([frames.StreamDelta("b", 0, "hel", 1)]))
        assert protocol.recv_frame(b) == {"frame": "deltas", "deltas": [["b", 0, "hel", 1]]}
