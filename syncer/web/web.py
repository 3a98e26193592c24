"""The syncer's web port (`--metrics-port`, on `--metrics-host`): `/metrics` for Prometheus, `/` the
live status page, `/status.json` the figures the page polls. The routes read only what the metrics
registry and the status board hand out; the HTTP shell (`yeto_core.web_server`) bounds what any
client may cost the syncer: a cap on connections, a deadline per request, an optional token. The
page is one static file shipped in the package (no CDN, no request beyond this port).
"""

from __future__ import annotations

import json
from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from syncer.web.status import StatusBoard
from yeto_core.web_server import MAX_CONNECTIONS, REQUEST_TIMEOUT_S, Reply, Route, WebServer, web_app


def page() -> bytes:
    return resources.files("syncer.web").joinpath("status_page.html").read_bytes()


def routes(registry: CollectorRegistry, board: StatusBoard) -> dict[str, Route]:
    """The web port's paths: the page (`/`, `/index.html`), its figures and the metrics."""
    html = Reply("text/html; charset=utf-8", page())

    def status() -> Reply:
        return Reply("application/json", json.dumps(board.snapshot(), separators=(",", ":"), default=str).encode())

    return {"/": lambda: html, "/index.html": lambda: html, "/status.json": status,
            "/metrics": lambda: Reply(CONTENT_TYPE_LATEST, generate_latest(registry))}


def serve(registry: CollectorRegistry, board: StatusBoard, host: str, port: int, *, token: bytes | None = None,
          max_connections: int = MAX_CONNECTIONS, request_timeout_s: float = REQUEST_TIMEOUT_S) -> WebServer:
    """Serve on host:port (0: a free port) from a daemon thread; with `token`, every path needs it.
    Raises OSError when the address cannot be bound; `server.port` is the bound port, `server.close()`
    stops it."""
    return WebServer(web_app(routes(registry, board), token=token), host, port, max_connections=max_connections,
                     request_timeout_s=request_timeout_s, name="syncer-web")
