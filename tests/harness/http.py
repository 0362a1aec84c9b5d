"""Local HTTP servers standing in for a served model (a teacher, a judge, an engine that never
answers): a test writes only what its handler answers; this file reads requests, writes replies
and starts and stops the server on a free local port."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """A request handler that reads JSON bodies and writes JSON (or raw) replies, quietly."""

    def read_json(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def reply(self, body: bytes, status: int = 200, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def reply_json(self, value: Any, status: int = 200) -> None:
        self.reply(json.dumps(value).encode(), status)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler],
            release: threading.Event | None = None) -> Iterator[str]:
    """Serve `handler` on a free local port; yields "http://127.0.0.1:PORT". On the way out,
    `release` is set first (handlers waiting on it, never answering while the test ran, return)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if release is not None:
            release.set()
        server.shutdown()
        server.server_close()
