"""`make run`'s ready line (serve_app/ready.py): printed once /health turns 200, never while it is 503."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from serve_app import ready


class Health(http.server.BaseHTTPRequestHandler):
    calls = 0
    ready_after = 3

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/health":
            Health.calls += 1
            status = 200 if Health.calls > Health.ready_after else 503
            body = {"status": "ok"} if status == 200 else {"error": {"message": "loading", "code": 503}}
        else:
            status, body = 200, {"object": "list", "data": [{"id": "local:tiny-llama"}]}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Health.calls = 0
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_prints_one_line_once_health_is_200(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert ready.main(["--url", server, "--interval", "0.01", "--timeout", "10"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"realtime-pd ready: {server} serves local:tiny-llama")
    assert Health.calls == Health.ready_after + 1  # it waited through every 503


def test_gives_up_when_the_server_process_is_gone(capsys: pytest.CaptureFixture[str]) -> None:
    assert ready.main(["--url", "http://127.0.0.1:9", "--watch-pid", "999999999", "--interval", "0.01"]) == 1
    assert "not ready" in capsys.readouterr().err
