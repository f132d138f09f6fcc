"""A job route whose Redis is not reachable answers 503 JOB_STORE_UNAVAILABLE with
Retry-After, never a 500 (the app is not started: no broker, no job driver)."""

from __future__ import annotations

import socket

from starlette.testclient import TestClient

from tasks.settings import Settings


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_job_route_without_redis_is_a_503() -> None:
    from gateway.app import create_app

    settings = Settings(redis_url=f"redis://127.0.0.1:{_closed_port()}/0")
    client = TestClient(create_app(settings), raise_server_exceptions=False)
    response = client.get("/v1/jobs/0123456789abcdef")
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "JOB_STORE_UNAVAILABLE"
    assert response.headers["retry-after"] == "1"
