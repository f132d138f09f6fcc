"""A small OTLP/HTTP trace receiver: what a collector would be, for a test or a benchmark.

`OtlpReceiver` listens on 127.0.0.1 (a free port) for `POST /v1/traces` with an
`ExportTraceServiceRequest` protobuf body (OTLP/HTTP's binary encoding, what
`OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf` sends) and keeps every span it is sent as a
`ReceivedSpan`: ids in hex, its resource's and its own attributes, its links. Anything
else is answered 400 or 404, and counted in `refused`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.stack import wait_for


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id) of each
    status_code: int = 0

    @property
    def component(self) -> str:
        return str(self.resource.get("shoal.component", ""))


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of an `ExportTraceServiceRequest`."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(ReceivedSpan(
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                    s.start_time_unix_nano, s.end_time_unix_nano, _attributes(s.attributes),
                    resource, tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links),
                    s.status.code))
    return out


def count_spans(body: bytes) -> int:
    """How many spans an `ExportTraceServiceRequest` carries (parsed, nothing kept)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)


@dataclass
class OtlpReceiver:
    """The receiver's server on its own thread (`start`, `stop`), and what it received."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    body_bytes: int = 0
    refused: int = 0
    span_count: int = 0
    keep: bool = True  # False: count spans, requests and bytes only (a benchmark's sink)

    def start(self) -> OtlpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/traces":
                    receiver._refuse(self, 404)
                    return
                try:
                    spans = decode(body) if receiver.keep else []
                    count = len(spans) if receiver.keep else count_spans(body)
                except Exception:  # a body that is no ExportTraceServiceRequest
                    receiver._refuse(self, 400)
                    return
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.span_count += count
                    receiver.requests += 1
                    receiver.body_bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def _refuse(self, handler: BaseHTTPRequestHandler, status: int) -> None:
        with self._lock:
            self.refused += 1
        handler.send_response(status)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def env(self) -> dict[str, str]:
        """The OTEL_* settings that send a process's spans here, promptly."""
        return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint,
                "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, found: Callable[[list[ReceivedSpan]], Any], timeout: float, what: str) -> Any:
        """`found(spans so far)` once it is truthy (or an AssertionError after `timeout`)."""
        def check() -> Any:
            with self._lock:
                spans = list(self.spans)
            return found(spans)

        try:
            return wait_for(check, timeout, what)
        except TimeoutError as exc:
            with self._lock:
                seen = [(s.component, s.name, s.trace_id[:8]) for s in self.spans]
            raise AssertionError(f"{exc}; received {len(seen)} spans: {seen[-40:]}, "
                                 f"refused {self.refused} exports") from None
