"""What a streamed completion may send so far: the same rule in every runtime.

A growing completion is decoded again after each token; its end may still change (an
incomplete UTF-8 character decodes as U+FFFD, and the beginning of a stop string will be
cut if the rest follows), so that part is held back until it cannot. What was sent is
always a prefix of the final text, so the deltas add up to it.
"""

from __future__ import annotations


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of a growing text may still change."""
    cut = len(text) - len(text.rstrip("\ufffd"))
    text = text[:len(text) - cut]
    partial = max((n for stop in stops for n in range(min(len(stop) - 1, len(text)), 0, -1)
                   if text.endswith(stop[:n])), default=0)
    return cut + partial


def sendable(text: str, sent: str, stops: tuple[str, ...], final: bool) -> str:
    """The text a stream may have sent once `text` is the completion so far (all of it when
    `final`): `sent` plus what may go now. `sent` itself when nothing may, or when decoding
    more tokens rewrote text already sent (rare with real tokenizers; the stream then waits
    for the final text and sends its tail if it still extends what went out)."""
    if not final:
        text = text[:len(text) - held_back(text, stops)]
    return text if len(text) > len(sent) and text.startswith(sent) else sent
