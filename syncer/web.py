"""The syncer's web port (`--metrics-port`): `/metrics` for Prometheus, `/` the live status page,
`/status.json` the figures the page polls. One small threaded HTTP server on a daemon thread; it
reads only what the metrics registry and the status board hand out, so a slow or hostile client
costs a thread of its own and never the coordinator's. The page is one static file shipped in the
package (no CDN, no request beyond this port).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from syncer.status import StatusBoard

log = logging.getLogger("yeto.syncer.web")
REQUEST_TIMEOUT_S = 10.0  # a client that stalls mid-request is cut after this


def page() -> bytes:
    return resources.files("syncer").joinpath("status_page.html").read_bytes()


class WebServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry, board: StatusBoard) -> None:
        self.registry = registry
        self.board = board
        self.page = page()
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: WebServer
    timeout = REQUEST_TIMEOUT_S

    def do_GET(self) -> None:  # the name http.server calls
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, CONTENT_TYPE_LATEST, generate_latest(self.server.registry))
        elif path == "/status.json":
            body = json.dumps(self.server.board.snapshot(), separators=(",", ":"), default=str).encode()
            self._reply(200, "application/json", body)
        elif path in ("/", "/index.html"):
            self._reply(200, "text/html; charset=utf-8", self.server.page)
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found: try /, /status.json or /metrics\n")

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def serve(registry: CollectorRegistry, board: StatusBoard, host: str, port: int) -> tuple[WebServer, int]:
    """Serve on host:port (0: a free port) from a daemon thread; the server and its port. Raises
    OSError when the port cannot be bound. `server.shutdown()` stops it."""
    server = WebServer((host, port), registry, board)
    threading.Thread(target=server.serve_forever, name="syncer-web", daemon=True).start()
    return server, int(server.server_address[1])
