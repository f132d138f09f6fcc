"""POST /v1/files' form reader (`gateway.edge.multipart_form`) under generated bodies: a
form split anywhere reads back as sent, and whatever bytes come, the reader ends in its
events or a 400, never another exception (the route would answer it 500). The JSON and
msgpack routes are fuzzed through the app in test_fuzz_routes.py; the upload is a stream
written to the blob store, so its parser is fuzzed here, alone."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.edge.error_shapes import openai_status
from gateway.edge.multipart_form import End, FormReader, Part, boundary_of
from tasks.errors import ShoalError

BOUNDARY = b"----shoalfuzz7MA4YWxkTrZu0gW"
_PIECES = [b"--", b"\r\n", b"\r\n\r\n", b"--" + BOUNDARY, b"\r\n--" + BOUNDARY,
           b'Content-Disposition: form-data; name="file"; filename="a.jsonl"',
           b'Content-Disposition: form-data; name="purpose"', b"batch", b"{}\n"]


def _form(fields: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for name, content in fields:
        out += (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"" +
                name.encode() + b"\"\r\n\r\n" + content + b"\r\n")
    return out + b"--" + BOUNDARY + b"--\r\n"


def _read(body: bytes, cuts: list[int]) -> list[object]:
    reader = FormReader(BOUNDARY)
    events: list[object] = []
    at = 0
    for cut in [*sorted(c % (len(body) + 1) for c in cuts), len(body)]:
        events += reader.feed(body[at:cut])
        at = cut
    reader.close()
    return events


def _fields(events: list[object]) -> list[tuple[str, bytes]]:
    fields: list[tuple[str, bytes]] = []
    for event in events:
        if isinstance(event, Part):
            fields.append((event.name, b""))
        elif isinstance(event, bytes):
            fields[-1] = (fields[-1][0], fields[-1][1] + event)
        else:
            assert isinstance(event, End)
    return fields


names = st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(names, st.binary(max_size=300)), min_size=1, max_size=4),
       st.lists(st.integers(min_value=0), max_size=8))
def test_a_form_split_anywhere_reads_back_as_sent(fields, cuts):
    # content that holds the delimiter would end its field early, as in any multipart body
    fields = [(n, c.replace(b"\r\n--", b"")) for n, c in fields]
    assert _fields(_read(_form(fields), cuts)) == fields


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_PIECES), st.binary(max_size=64)), max_size=24),
       st.lists(st.integers(min_value=0), max_size=6))
def test_any_bytes_end_in_events_or_a_400(pieces, cuts):
    try:
        _read(b"".join(pieces), cuts)
    except ShoalError as error:  # on /v1/files, OpenAI's 400 (shoal's 422 elsewhere)
        assert openai_status(error) == 400 and error.message, error


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=80))
def test_any_content_type_gives_a_boundary_or_a_400(content_type):
    try:
        assert boundary_of(content_type)
    except ShoalError as error:
        assert openai_status(error) == 400
