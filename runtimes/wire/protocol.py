"""Frames between a worker and its model runtime process: length-prefixed msgpack.

A frame is a 4-byte big-endian body length followed by a msgpack body (the frames
themselves are `runtimes.wire.frames`). Only msgpack is ever decoded (never pickle), so a
compromised or confused peer can send wrong data but cannot run code in the other
process.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

MAX_FRAME_BYTES = 256 * 1024 * 1024
PROBE_ID = "probe"  # the id of the one outcome a probe frame is answered with
_HEADER = struct.Struct(">I")
# Made once: an encoder keeps no state between calls (and holds the GIL through one), so
# the threads of both sides share it.
_ENCODER = msgspec.msgpack.Encoder()
_ANY = msgspec.msgpack.Decoder()


class ProtocolError(ValueError):
    """The peer sent something that is not a valid frame."""


class FrameTooLarge(ProtocolError):
    """A frame over MAX_FRAME_BYTES, refused before anything is sent or read."""


class MalformedFrame(ProtocolError):
    """A whole msgpack frame, but not one the reader expects (its body was read: the
    stream stays in step)."""


class ConnectionClosed(EOFError):
    """The peer closed the connection (or died)."""


def encode_frame(obj: Any) -> bytearray:
    """Header + body; raises FrameTooLarge (nothing sent yet, the stream stays usable)."""
    frame = bytearray(_HEADER.size)
    _ENCODER.encode_into(obj, frame, _HEADER.size)  # the body after room for its header
    length = len(frame) - _HEADER.size
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(
            f"frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit"
        )
    _HEADER.pack_into(frame, 0, length)
    return frame


def send_frame(sock: socket.socket, obj: Any) -> None:
    sock.sendall(encode_frame(obj))


def recv_frame(sock: socket.socket, decoder: msgspec.msgpack.Decoder[Any] = _ANY) -> Any:
    """The next frame, decoded by `decoder` (a `runtimes.wire.frames` one; by default any
    msgpack value). MalformedFrame when it is msgpack but not of the decoder's type."""
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size, first=True))
    if length > MAX_FRAME_BYTES:
        # The body is not read, so the stream is out of step: the caller must drop it.
        raise FrameTooLarge(f"peer announced a {length}-byte frame, over {MAX_FRAME_BYTES}")
    body = _recv_exactly(sock, length, first=False)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise MalformedFrame(f"unexpected frame: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"frame body is not msgpack: {exc}") from exc


def _recv_exactly(sock: socket.socket, n: int, *, first: bool) -> bytearray:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        received = sock.recv_into(view[got:])
        if received == 0:
            where = "between frames" if first and got == 0 else "in the middle of a frame"
            raise ConnectionClosed(f"connection closed {where}")
        got += received
    return buffer  # decoded in place: no copy of a large frame
