"""The transport against a server that is not gradflow: one clear line, never the
page it answered with."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from gradflow.delivery.transport import Client, Refused

PAGE = b"<!DOCTYPE html><html><body><h1>Not Found</h1>" + b"x" * 500 + b"</body></html>"


class NotGradflow(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    do_GET = do_PUT = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotGradflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_that_is_not_gradflow_is_one_line_not_its_page(web_server: str) -> None:
    with pytest.raises(Refused) as refused:
        Client(web_server, None, timeout=5).post_steps("run", ['{"step": 0}'])
    message = str(refused.value)
    assert "<html" not in message and "Not Found" not in message, message
    assert "text/html" in message and "is it a gradflow server?" in message, message
    assert "\n" not in message
