"""An OpenAI batch's lines: input lines read and checked, output and error lines written in
OpenAI's format, the lines file read from any offset, an upload's multipart form read as it
streams, and the batch object's status while its job runs."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest

from gateway.edge.multipart_form import End, FormReader, Part, boundary_of
from gateway.jobs.batch_lines import (
    INVALID_JSON,
    INVALID_REQUEST,
    MISMATCHED_URL,
    LineError,
    RecordReader,
    answered,
    never_ran,
    pack_record,
    read_line,
    split_lines,
)
from gateway.jobs.batch_store import Batch, batch_object, final_fields
from gateway.jobs.store import CANCELLED, RUNNING, SUCCEEDED, Job
from tasks.errors import ShoalError

EMBED = "/v1/embeddings"


def _raw(**fields) -> bytes:
    return json.dumps({"custom_id": "a", "method": "POST", "url": EMBED, "body": {"input": "x"},
                       **fields}).encode()


def test_a_good_line_gives_its_custom_id_and_body_and_a_blank_one_nothing():
    line = read_line(_raw(), 1, EMBED)
    assert line is not None and (line.custom_id, line.body) == ("a", {"input": "x"})
    assert read_line(b"  \r", 2, EMBED) is None


@pytest.mark.parametrize(("raw", "code", "custom_id", "says"), [
    (b"not json", INVALID_JSON, None, "line 3 is not JSON"),
    (b"[1, 2]", INVALID_JSON, None, "JSON list"),
    (_raw(custom_id=7), INVALID_REQUEST, None, "'custom_id' must be"),
    (_raw(custom_id="x" * 513), INVALID_REQUEST, None, "at most 512"),
    (_raw(method="GET"), INVALID_REQUEST, "a", "'method' must be"),
    (_raw(url="/v1/completions"), MISMATCHED_URL, "a", "this batch's endpoint is"),
    (_raw(body=["x"]), INVALID_REQUEST, "a", "'body' must be an object"),
])
def test_a_line_with_a_wrong_frame_says_what_is_wrong(raw, code, custom_id, says):
    with pytest.raises(LineError) as caught:
        read_line(raw, 3, EMBED)
    assert (caught.value.code, caught.value.custom_id) == (code, custom_id)
    assert says in caught.value.message


def test_lines_split_across_chunks():
    chunks = [b"one\ntw", b"o\n", b"", b"thr", b"ee"]
    assert list(split_lines(chunks)) == [b"one", b"two", b"three"]
    assert list(split_lines([b"a\n"])) == [b"a"]


def test_output_and_error_lines_are_openai_s():
    row = np.array([0.5, -1.25], dtype=np.float32)
    ok = json.loads(answered("c1", 200, {"data": [{"embedding": row}]}, "req_1"))
    assert ok["id"].startswith("batch_req_") and ok["custom_id"] == "c1"
    assert ok["response"] == {"status_code": 200, "request_id": "req_1",
                              "body": {"data": [{"embedding": [0.5, -1.25]}]}}
    assert ok["error"] is None
    failed = json.loads(never_ran(None, "invalid_json_line", "line 2 is not JSON"))
    assert failed["response"] is None and failed["custom_id"] is None
    assert failed["error"] == {"code": "invalid_json_line", "message": "line 2 is not JSON"}
    assert answered("c", 200, {}, "r").endswith(b"\n") and b"\n" not in answered("c", 200, {},
                                                                                   "r")[:-1]


def test_error_lines_carry_the_sync_route_s_status_and_envelope():
    from gateway.jobs.batch_output import error_line

    error = ShoalError("VALIDATION_ERROR", "'input' must be a string or a list")
    line = json.loads(error_line(EMBED, "c9", error, "req_9"))
    assert line["response"]["status_code"] == 400  # OpenAI's status for a field's value
    assert line["response"]["body"] == {"error": {
        "message": "'input' must be a string or a list", "type": "invalid_request_error",
        "param": "input", "code": "VALIDATION_ERROR"}}


def test_records_read_back_in_order_from_any_offset():
    data = b"".join(pack_record(n, f"c{n}", {"model": "m", "items": [{"image": b"\x00\xff"}]},
                                {"input": str(n)}) for n in range(1, 6))
    reader = RecordReader(io.BytesIO(data))
    first = reader.next()
    assert first is not None and (first.line, first.custom_id) == (1, "c1")
    assert first.kwargs["items"][0]["image"] == b"\x00\xff"
    resumed = RecordReader(io.BytesIO(data), reader.offset)
    assert [r.custom_id for r in iter(resumed.next, None)] == ["c2", "c3", "c4", "c5"]
    assert RecordReader(io.BytesIO(data), len(data)).next_part() == []
    cut = RecordReader(io.BytesIO(data[:-3]))
    for _ in range(4):
        cut.next()
    with pytest.raises(ValueError, match="ends inside a record"):
        cut.next()


def _form(**files) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://x/v1/files", data={"purpose": "batch"}, files=files)
    return request.headers["content-type"], request.read()


@pytest.mark.parametrize("piece", [1, 5, 70, 1 << 20])
def test_a_form_read_in_pieces_of_any_size(piece):
    content = b"line one\r\n--not-the-boundary\r\n" * 300
    kind, body = _form(file=("in.jsonl", content))
    form = FormReader(boundary_of(kind))
    events = [e for i in range(0, len(body), piece) for e in form.feed(body[i:i + piece])]
    form.close()
    fields: dict[str, bytes] = {}
    current = None
    for event in events:
        if isinstance(event, Part):
            current = event
            fields[event.name] = b""
        elif isinstance(event, End):
            current = None
        else:
            fields[current.name] += event
    assert fields == {"purpose": b"batch", "file": content}
    assert [e for e in events if isinstance(e, Part)][1] == Part("file", "in.jsonl")


def test_a_form_cut_short_or_not_a_form_is_a_400():
    kind, body = _form(file=("in.jsonl", b"abc"))
    form = FormReader(boundary_of(kind))
    form.feed(body[:-10])
    with pytest.raises(ShoalError, match="cut off"):
        form.close()
    for content_type in (None, "application/json", "multipart/form-data"):
        with pytest.raises(ShoalError, match="multipart/form-data"):
            boundary_of(content_type)


def _job(state: str, done: int, ok: int, total: int = 10) -> Job:
    return Job(id="j", operation="encode", model="m", state=state, parts_total=total,
               parts_done=done, items_done=ok, batch="batch_1", result_file="file-o file-e")


def test_a_running_batch_shows_its_job_s_counts_and_then_its_end():
    batch = Batch("batch_1", EMBED, "file-in", total=12, refused=2, job_id="j")
    shown = batch_object(batch, _job(RUNNING, 4, 3))
    assert shown["status"] == "in_progress" and shown["object"] == "batch"
    assert shown["request_counts"] == {"total": 12, "completed": 3, "failed": 3}
    assert batch_object(batch, _job(RUNNING, 10, 9))["status"] == "finalizing"
    assert batch_object(batch, _job(CANCELLED, 4, 3))["status"] == "cancelling"
    assert final_fields(batch, _job(RUNNING, 4, 3)) is None
    end = final_fields(batch, _job(SUCCEEDED, 10, 9))
    assert end is not None and end["status"] == "completed"
    assert (end["output_file_id"], end["error_file_id"]) == ("file-o", "file-e")
    assert (end["completed"], end["failed"]) == (9, 3)
    lost = final_fields(batch, None)
    assert lost is not None and lost["status"] == "failed"


def test_a_batch_s_lines_coalesced_stay_bulk_for_the_worker():
    from tasks.envelope import H_BULK, Annotations, Part, coalesce, read_coalesced

    def part(task_id: str, bulk: bool) -> Part:
        return Part(task_id, Annotations("m", "encode", 1, 5, 5, None, None, bulk=bulk), b"x")

    message = coalesce("m", "encode", [part("j.0", True), part("j.1", True)], "gw")
    assert message.headers[H_BULK] == 1
    assert [p.annotations.bulk for p in read_coalesced(message.headers, message.body)] == \
        [True, True]
    mixed = coalesce("m", "encode", [part("a", True), part("b", False)], "gw")
    assert H_BULK not in mixed.headers
    assert not any(p.annotations.bulk for p in read_coalesced(mixed.headers, mixed.body))


def test_every_endpoint_answers_with_its_sync_route_s_body():
    from gateway.jobs.batch_output import RENDERERS
    from gateway.routes.batch_endpoints import ENDPOINTS, TASKS

    assert set(RENDERERS) == set(TASKS) == set(ENDPOINTS)
    vectors = np.array([[1.0, 2.0]], dtype="<f4")
    embedded = RENDERERS[EMBED]({"model": "m:lora", "input": "x"}, {
        "output": "dense", "dims": 2, "count": 1, "dtype": "float32",
        "embeddings": vectors.tobytes(), "usage": {"tokens": 3}}, "req_1", "m")
    assert json.loads(answered("c", 200, embedded, "req_1"))["response"]["body"] == {
        "object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [1.0, 2.0]}],
        "model": "m:lora", "usage": {"prompt_tokens": 3, "total_tokens": 3}}
    generated = {"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    chat = RENDERERS["/v1/chat/completions"]({"model": "g", "messages": []}, generated, "r", "g")
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    completion = RENDERERS["/v1/completions"]({"model": "g", "prompt": "x"}, generated, "r", "g")
    assert completion["object"] == "text_completion" and completion["choices"][0]["text"] == "hi"
    ranked = RENDERERS["/v1/rerank"](
        {"model": "r", "query": "q", "documents": ["a", "b"], "top_n": 1,
         "return_documents": True}, {"scores": [0.1, 0.9], "usage": {"tokens": 7}}, "req_7", "r")
    assert ranked == {"id": "req_7", "results": [{"index": 1, "relevance_score": 0.9,
                                                  "document": {"text": "b"}}],
                      "meta": {"tokens": {"input_tokens": 7, "output_tokens": 0}},
                      "model": "r", "usage": {"total_tokens": 7}}


def test_a_generate_line_that_streams_is_refused():
    from gateway.routes.batch_endpoints import TASKS

    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        with pytest.raises(ShoalError, match="'stream' is not supported in a batch"):
            TASKS[endpoint](None, {"model": "g", "prompt": "x", "stream": True})
