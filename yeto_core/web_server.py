"""The HTTP shell of yeto's web ports: the syncer's status page and `/metrics`, an island's `/metrics`.

A web port answers whoever reaches it, so what it may cost the process is bounded, whatever a
client does:

- **Connections**: at most `max_connections` at once. At the cap the listening socket is no
  longer accepted from; newcomers wait in the kernel's backlog and hold no descriptor of ours,
  and the event loop sleeps instead of spinning on a socket it cannot serve.
- **Time**: a connection has `request_timeout_s` to deliver each whole request, counted from its
  accept and again from each answer, however slowly its bytes trickle in; past it the connection
  is closed. So an idle keep-alive connection lasts `request_timeout_s` after its last answer, a
  client that never reads its answer is closed as well, and a browser or Prometheus simply
  reconnects for its next request.
- **Threads**: one event-loop thread and `THREADS` worker threads, however many connections.
- **Input**: a request line that is not printable ASCII (binary junk, a TLS hello) is answered
  400 at once, as is a request head over `MAX_HEAD_BYTES`; a body over `MAX_BODY_BYTES` is 413.
  Those answers are waitress's short plain-text ones, never a page of ours.
- **Access**: with a token, every path needs `Authorization: Bearer <token>` (what Prometheus sends
  from `authorization: credentials_file:`), or HTTP Basic with the token as the password (any
  user name) so that a browser can open the page; anything else is 401 with a Basic challenge.
- **Log**: trouble (the cap reached, accept failing for want of descriptors) is one warning per
  burst, never one per connection.

waitress does the HTTP; this module sets its limits and replaces its inactivity timeout (which a
trickle of one byte every few seconds never trips) with the per-request deadline above.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hmac
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher
from waitress.utilities import BadRequest, RequestHeaderFieldsTooLarge

from yeto_core.settings import SettingsError, read_secret_file

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger("yeto.web")
# waitress's per-connection notes (a client gone before its answer, at INFO) would be a line per
# connection in a flood; what a connection logs at WARNING or above is a fault of ours and stays.
connection_log = logging.getLogger("yeto.web.connection")
connection_log.setLevel(logging.WARNING)

MAX_CONNECTIONS = 32
REQUEST_TIMEOUT_S = 10.0
THREADS = 2  # the answers are small and made in microseconds; more threads would only cost memory
MAX_HEAD_BYTES = 16 * 1024  # request line and headers; a browser's fit with room to spare
MAX_BODY_BYTES = 16 * 1024  # GET needs none; a body is read (into memory) before the answer
OUTBUF_BYTES = 64 * 1024 * 1024  # answers stay in memory (waitress would spill larger ones to a temporary file)
BACKLOG = 1024  # connections the kernel holds (without a descriptor of ours) while we are at the cap
LOOP_WAKE_S = 0.25  # the loop wakes at least this often to close connections past their deadline
ACCEPT_PAUSE_S = 0.5  # accept() failed for want of descriptors or memory: wait this long before the next
QUIET_S = 30.0  # a kind of trouble is logged again only after this long without it
CLOSE_WAIT_S = 5.0
# A request line as far as it has arrived: a method token, then printable ASCII (RFC 9112 3).
REQUEST_LINE_SO_FAR = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]*(?: [\x20-\x7e]*)?\r?")
# Refused accepts that say "the process is short of something", not "this one connection failed".
SHORT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Reply(NamedTuple):
    """What a route answers: its content type and body."""

    content_type: str
    body: bytes


Route = Callable[[], Reply]


# -- the application: routes behind an optional token -------------------------------------------
def read_token(path: Path, name: str) -> bytes:
    """A bearer token from its file (`read_secret_file`'s rules: a regular file, size-capped), which
    must be printable ASCII without spaces, as an HTTP header carries it. `name` is the setting
    errors name. Raises SettingsError."""
    token = read_secret_file(path, name, what="token")
    if not re.fullmatch(rb"[\x21-\x7e]+", token):
        raise SettingsError(f"{name}={path}: a token is printable ASCII without spaces (an HTTP header carries it)")
    return token


def authorized(header: str, token: bytes) -> bool:
    """Whether an `Authorization` header carries the token: `Bearer <token>`, or `Basic` with the
    token as the password. Compared in constant time."""
    scheme, _, credentials = header.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer":
        given = credentials.encode("latin-1")  # a WSGI header value is latin-1 text
    elif scheme.lower() == "basic":
        try:
            given = base64.b64decode(credentials, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
    else:
        return False
    return hmac.compare_digest(given, token)


def web_app(routes: Mapping[str, Route], *, token: bytes | None = None) -> WSGIApplication:
    """A WSGI application answering GET (and HEAD) of `routes` (path → reply), 404 elsewhere; with
    `token`, 401 for any request without it, whatever its path."""
    known = ", ".join(sorted(routes))
    not_found = f"not found: try {known}\n".encode()
    need_token = (b"this port needs its token: send 'Authorization: Bearer <token>', or any user name "
                  b"with the token as the password\n")

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        head_only = environ.get("REQUEST_METHOD") == "HEAD"
        if token is not None and not authorized(environ.get("HTTP_AUTHORIZATION", ""), token):
            return answer(start_response, HTTPStatus.UNAUTHORIZED, Reply(TEXT, need_token), head_only,
                          [("WWW-Authenticate", 'Basic realm="yeto", charset="UTF-8"')])
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return answer(start_response, HTTPStatus.METHOD_NOT_ALLOWED, Reply(TEXT, b"GET only\n"), head_only,
                          [("Allow", "GET, HEAD")])
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return answer(start_response, HTTPStatus.NOT_FOUND, Reply(TEXT, not_found), head_only)
        return answer(start_response, HTTPStatus.OK, route(), head_only)

    return app


TEXT = "text/plain; charset=utf-8"


def answer(start_response: StartResponse, status: HTTPStatus, reply: Reply, head_only: bool,
           extra: list[tuple[str, str]] | None = None) -> list[bytes]:
    start_response(f"{status.value} {status.phrase}", [
        ("Content-Type", reply.content_type), ("Content-Length", str(len(reply.body))),
        ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"), *(extra or [])])
    return [b"" if head_only else reply.body]


# -- the server ------------------------------------------------------------------------------------
class WebServer:
    """Serves `app` on host:port (0: a free port) from a daemon thread, within the limits the module
    states. Raises OSError (`socket.gaierror` for a host that does not resolve) when it cannot
    listen; `host` and `port` are the bound ones. `close()` stops it and closes every connection."""

    def __init__(self, app: WSGIApplication, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, name: str = "yeto-web") -> None:
        if max_connections < 1 or request_timeout_s <= 0:
            raise ValueError(f"need max_connections >= 1 and request_timeout_s > 0, got {max_connections} "
                             f"and {request_timeout_s}")
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
        # The address is bound from `sockinfo` below; host and port here only spare waitress resolving
        # its default 0.0.0.0:8080. Its inactivity timeout is unused: `_Listener.expire` replaces it.
        adj = Adjustments(host="127.0.0.1", port=0, threads=THREADS, connection_limit=max_connections, backlog=BACKLOG,
                          max_request_header_size=MAX_HEAD_BYTES, max_request_body_size=MAX_BODY_BYTES,
                          outbuf_overflow=OUTBUF_BYTES, ident="yeto", log_socket_errors=False,
                          asyncore_use_poll=True)  # select() cannot watch a descriptor numbered past 1023
        self._map: dict[int, Any] = {}
        self._tasks = _Tasks(name)
        try:
            self._listener = _Listener(app, map=self._map, dispatcher=self._tasks, adj=adj,
                                       sockinfo=(family, kind, proto, address), request_timeout_s=request_timeout_s)
        except BaseException:
            wasyncore.close_all(self._map)  # the wake-up pipe waitress made before it bound
            raise
        self.host, self.port = str(self._listener.effective_host), int(self._listener.effective_port)
        self._closing = threading.Event()
        self._map_lock = threading.Lock()  # the wake-up pipe is not written once the loop has closed it
        self._tasks.set_thread_count(THREADS)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._listener.active_channels)

    def _serve(self) -> None:
        try:
            while not self._closing.is_set():
                wasyncore.poll2(LOOP_WAKE_S, self._map)
                self._listener.expire(time.monotonic())
        except Exception:  # a bug of ours or waitress's: the port stops, the process goes on
            log.exception("web port %s:%d stopped", self.host, self.port)
        finally:
            self._tasks.shutdown(timeout=CLOSE_WAIT_S)
            with self._map_lock:
                wasyncore.close_all(self._map, ignore_all=True)

    def close(self) -> None:
        """Stop serving and close the port and every connection (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        with self._map_lock:
            if self._map:
                self._listener.pull_trigger()  # wake the loop now rather than at its next timeout
        self._thread.join(CLOSE_WAIT_S * 2)


class _Parser(HTTPRequestParser):
    """waitress's request parser, but junk is a 400 at its first bytes rather than a 431 once it has
    filled the head's cap, and an oversized head is a 400 too."""

    error: Any
    completed: bool

    def received(self, data: bytes) -> int:
        consumed = int(super().received(data))
        if isinstance(self.error, RequestHeaderFieldsTooLarge):
            self.error = BadRequest(f"the request head is over {MAX_HEAD_BYTES} bytes")
        elif not self.completed and not self.headers_finished:
            first_line = self.header_plus.lstrip(b"\r\n").partition(b"\n")[0]
            if not REQUEST_LINE_SO_FAR.fullmatch(first_line):
                self.parse_header(b"GET / HTTP/1.0\r\n")  # what waitress's error answer reads
                self.error = BadRequest("this is not an HTTP request")
                self.completed = True
        return consumed


class _Channel(HTTPChannel):
    """One connection. `window_start` opens its deadline: its accept, then the end of each answer."""

    parser_class = _Parser
    logger = connection_log

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window_start = time.monotonic()

    def service(self) -> None:
        try:
            super().service()
        finally:
            self.window_start = time.monotonic()


class _Listener(TcpWSGIServer):
    """The listening socket: accepts below the cap, and closes connections past their deadline."""

    channel_class = _Channel
    logger = log

    def __init__(self, *args: Any, request_timeout_s: float, **kwargs: Any) -> None:
        self.request_timeout_s = request_timeout_s
        self._full_seen = self._short_seen = -QUIET_S  # when the cap was last met, when accept last failed
        self._paused_until = 0.0
        super().__init__(*args, **kwargs)

    def readable(self) -> bool:
        """Accept only below the cap (and not right after accept failed for want of descriptors):
        waitress's own check counts its wake-up pipe and the listener as connections, and logs
        each time the cap is met."""
        if not self.accepting:
            return False
        now = time.monotonic()
        if now < self._paused_until:
            return False
        if len(self.active_channels) < self.adj.connection_limit:
            return True
        if now - self._full_seen > QUIET_S:
            log.warning("web port %s:%s: %d connections, its cap; new ones wait in the kernel's queue until one "
                        "answers or is cut at its %g s deadline", self.effective_host, self.effective_port,
                        len(self.active_channels), self.request_timeout_s)
        self._full_seen = now
        return False

    def handle_accept(self) -> None:
        try:
            conn, addr = self.socket.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:
            if exc.errno not in SHORT_OF_RESOURCES:
                return
            # The listening socket stays readable while accept() fails: without a pause the loop
            # would spin on it.
            now = time.monotonic()
            self._paused_until = now + ACCEPT_PAUSE_S
            if now - self._short_seen > QUIET_S:
                log.warning("web port %s:%s: cannot accept a connection (%s); trying again every %g s",
                            self.effective_host, self.effective_port, exc.strerror, ACCEPT_PAUSE_S)
            self._short_seen = now
            return
        try:
            self.set_socket_options(conn)
            self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)
        except OSError:  # reset before we got to it
            conn.close()

    def expire(self, now: float) -> None:
        """Close the connections whose request (or answer's delivery) is past its deadline. One
        with a request in a worker thread is left to it: the answers are made at once."""
        for channel in list(self.active_channels.values()):
            if not channel.requests and now - channel.window_start > self.request_timeout_s:
                channel.handle_close()


class _Tasks(ThreadedTaskDispatcher):
    """waitress's worker threads, named after the port, and without its warning per queued request
    (a queue is what the connection cap is for)."""

    logger = log

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def start_new_thread(self, target: Callable[[int], None], thread_no: int) -> None:
        threading.Thread(target=target, name=f"{self.name}-{thread_no}", args=(thread_no,), daemon=True).start()

    def add_task(self, task: Any) -> None:
        with self.lock:
            self.queue.append(task)
            self.queue_cv.notify()
