"""The web ports' HTTP shell on loopback: routes, the token, 400 for what is not HTTP, the deadline
per request that a trickle cannot stretch, and the connection cap that a flood meets without
threads, descriptors, CPU or log lines growing with it."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import random
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from yeto_core.settings import SettingsError
from yeto_core.web_server import Reply, WebServer, read_token, web_app

pytestmark = pytest.mark.unit
PAGE = b"<!doctype html><html><body>the page</body></html>"
TOKEN = b"s3cret-token_42"
ROUTES = {"/": lambda: Reply("text/html; charset=utf-8", PAGE), "/metrics": lambda: Reply("text/plain", b"up 1\n")}


@contextlib.contextmanager
def serving(token: bytes | None = None, **limits: float) -> Iterator[WebServer]:
    server = WebServer(web_app(ROUTES, token=token), "127.0.0.1", 0, **limits)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.close()


def connect(server: WebServer, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=timeout)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after its answer ends it too)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def exchange(server: WebServer, request: bytes) -> bytes:
    with connect(server) as sock:
        sock.sendall(request)
        return read_all(sock)


def get(server: WebServer, path: str, *headers: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Connection: close", *headers]
    raw = exchange(server, ("\r\n".join(lines) + "\r\n\r\n").encode())
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *fields = head.decode("latin-1").split("\r\n")
    return int(status.split()[1]), {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}, body


def basic(user: str, password: bytes) -> str:
    return "Authorization: Basic " + base64.b64encode(user.encode() + b":" + password).decode()


def test_routes_answer_and_anything_else_is_404() -> None:
    with serving() as server:
        code, headers, body = get(server, "/metrics")
        assert (code, headers["content-type"], body) == (200, "text/plain", b"up 1\n")
        assert headers["cache-control"] == "no-store"
        assert get(server, "/?since=3")[::2] == (200, PAGE)
        code, headers, body = get(server, "/nope")
        assert (code, body) == (404, b"not found: try /, /metrics\n")
        assert headers["content-type"].startswith("text/plain")
        code, headers, body = get(server, "/metrics", method="HEAD")
        assert (code, headers["content-length"], body) == (200, "5", b"")
        code, headers, _ = get(server, "/metrics", method="POST")
        assert (code, headers["allow"]) == (405, "GET, HEAD")


@pytest.mark.parametrize(("header", "code"), [
    (None, 401),
    ("Authorization: Bearer wrong-token", 401),
    ("Authorization: Bearer " + TOKEN.decode(), 200),
    (basic("anyone", TOKEN), 200),
    (basic("", TOKEN), 200),
    (basic(TOKEN.decode(), b"wrong"), 401),
    ("Authorization: Basic !!not-base64!!", 401),
    ("Authorization: " + TOKEN.decode(), 401),
])
def test_with_a_token_every_path_needs_it_as_bearer_or_basic_password(header: str | None, code: int) -> None:
    with serving(token=TOKEN) as server:
        for path in ("/metrics", "/", "/nope"):
            got, headers, body = get(server, path, *([header] if header else []))
            assert got == (code if path != "/nope" or code == 401 else 404), (path, header)
            if got == 401:
                assert headers["www-authenticate"] == 'Basic realm="yeto", charset="UTF-8"'
                assert b"Bearer <token>" in body and PAGE not in body and b"up 1" not in body


def test_without_a_token_any_authorization_is_ignored() -> None:
    with serving() as server:
        assert get(server, "/metrics", "Authorization: Bearer whatever")[0] == 200


def assert_plain_400(raw: bytes) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 400 Bad Request\r\n"), raw[:200]
    assert b"Content-Type: text/plain" in head and b"<html" not in body.lower() and len(body) < 200, raw[:300]


def junk_sender(sock: socket.socket, junk: bytes) -> threading.Thread:
    """Send `junk` on a thread (the server stops reading after its answer: the rest may never go)."""
    def send() -> None:
        with contextlib.suppress(OSError):
            sock.sendall(junk)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind", ["random bytes", "random bytes with newlines", "text lines, never a blank one"])
def test_a_megabyte_of_junk_is_a_plain_400(kind: str) -> None:
    rng = random.Random(kind)
    if kind == "random bytes":
        junk = rng.randbytes(1 << 20)
    elif kind == "random bytes with newlines":
        junk = b"\r\n".join(rng.randbytes(rng.randrange(1, 80)) for _ in range(1 << 15))[: 1 << 20]
    else:
        junk = b"".join(b"GET /%d HTTP/1.1\r\nX-%d: y\r\n" % (i, i) for i in range(40000))[: 1 << 20]
    with serving() as server, connect(server) as sock:
        sender = junk_sender(sock, junk)
        assert_plain_400(read_all(sock))
        sender.join(5)
        assert get(server, "/metrics")[0] == 200  # and the port goes on


def test_a_trickle_is_cut_at_the_request_deadline() -> None:
    with serving(request_timeout_s=1.0) as server, connect(server) as sock:
        started = time.monotonic()
        sock.settimeout(0.2)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
        closed_after = None
        for byte in request:  # a byte every 0.2 s: never idle for long, never done
            try:
                sock.send(bytes([byte]))
                if sock.recv(1) == b"":
                    closed_after = time.monotonic() - started
                    break
            except TimeoutError:
                continue
            except OSError:
                closed_after = time.monotonic() - started
                break
        assert closed_after is not None and 0.9 < closed_after < 2.5, closed_after


def test_the_deadline_restarts_with_each_answer_on_a_kept_connection() -> None:
    with serving(request_timeout_s=1.0) as server, connect(server) as sock:
        for _ in range(3):  # 3 requests 0.6 s apart: 1.8 s on one connection, each within its deadline
            time.sleep(0.6)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"up 1\n"):
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        sock.settimeout(3)
        started = time.monotonic()
        assert sock.recv(1) == b""  # idle after its answer: closed at the deadline
        assert time.monotonic() - started < 2.0


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_flood_at_the_cap_waits_in_the_backlog_costing_no_thread_descriptor_or_cpu(
        caplog: pytest.LogCaptureFixture) -> None:
    cap, flood = 4, 60
    with serving(max_connections=cap, request_timeout_s=1.0) as server, caplog.at_level(logging.INFO, "yeto.web"):
        threads, descriptors = threading.active_count(), open_descriptors()
        idlers = [connect(server) for _ in range(flood)]  # the kernel completes each; we accept `cap`
        try:
            late = connect(server)
            late.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            cpu = resource.getrusage(resource.RUSAGE_SELF)
            time.sleep(0.6)
            used = resource.getrusage(resource.RUSAGE_SELF)
            assert server.connections == cap
            assert threading.active_count() == threads
            # ours: the flood's client ends; the server's: its `cap` accepted connections, no more
            assert open_descriptors() - descriptors == flood + 1 + cap
            assert (used.ru_utime + used.ru_stime) - (cpu.ru_utime + cpu.ru_stime) < 0.15, "the loop spins at the cap"
            late.settimeout(0.3)
            with pytest.raises(TimeoutError):  # queued in the backlog: no answer yet
                late.recv(1)
            for sock in idlers:  # the flood ends: its queued connections read EOF and go at once
                sock.close()
            late.settimeout(5)
            started = time.monotonic()
            assert read_all(late).startswith(b"HTTP/1.1 200 OK\r\n")
            assert time.monotonic() - started < 2.5  # the accepted idlers are cut at their 1 s deadline
        finally:
            for sock in idlers:
                sock.close()
        assert threading.active_count() == threads
    cap_lines = [r for r in caplog.records if "its cap" in r.getMessage()]
    assert len(cap_lines) == 1, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.name.startswith("waitress")]


def test_a_silent_crowd_is_cut_by_the_deadline_and_then_a_request_is_served() -> None:
    with serving(max_connections=4, request_timeout_s=1.0) as server:
        crowd = [connect(server) for _ in range(8)]  # 4 held, 4 queued behind them
        try:
            time.sleep(0.2)
            assert server.connections == 4
            started = time.monotonic()
            code, _, body = get(server, "/metrics")  # queued behind both halves of the crowd
            assert (code, body) == (200, b"up 1\n")
            assert 0.7 < time.monotonic() - started < 4.0
        finally:
            for sock in crowd:
                sock.close()


def test_close_stops_the_port_its_threads_and_its_connections() -> None:
    threads = threading.active_count()
    server = WebServer(web_app(ROUTES), "127.0.0.1", 0)
    assert threading.active_count() == threads + 3  # the loop and two workers, whatever the load
    held = connect(server)
    time.sleep(0.1)
    server.close()
    server.close()
    assert read_all(held) == b""
    held.close()
    with pytest.raises(ConnectionRefusedError):
        connect(server)
    assert threading.active_count() == threads


def test_an_address_it_cannot_bind_is_an_oserror() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        threads = threading.active_count()
        with pytest.raises(OSError, match="Address already in use"):
            WebServer(web_app(ROUTES), "127.0.0.1", taken.getsockname()[1])
        assert threading.active_count() == threads
    with pytest.raises(socket.gaierror):
        WebServer(web_app(ROUTES), "no-such-host.invalid", 0)


def test_a_token_file_is_one_printable_word(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"  " + TOKEN + b"\n")
    path.chmod(0o600)
    assert read_token(path, "--metrics-token-file") == TOKEN
    for bad, why in ((b"\n", "empty"), (b"two words", "without spaces"), ("jeton-é".encode(), "printable ASCII")):
        path.write_bytes(bad)
        with pytest.raises(SettingsError, match=f"^--metrics-token-file={path}: .*{why}"):
            read_token(path, "--metrics-token-file")
    with pytest.raises(SettingsError, match="not a regular file"):
        read_token(tmp_path, "YETO_SYNCER_METRICS_TOKEN_FILE")


OUT_OF_DESCRIPTORS = """
import logging, os, resource, sys, time
from yeto_core.web_server import Reply, WebServer, web_app
logging.basicConfig(stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
server = WebServer(web_app({"/": lambda: Reply("text/plain", b"ok")}), "127.0.0.1", 0, max_connections=1024)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, resource.getrlimit(
    resource.RLIMIT_NOFILE)[1]))
print(server.port, flush=True)
sys.stdin.readline()  # the flood is in: accept() fails with EMFILE from here on
time.sleep(0.5)
start = time.process_time()
time.sleep(2.0)
print(time.process_time() - start, server.connections, flush=True)
"""


@pytest.mark.timeout(60)
def test_out_of_descriptors_the_loop_pauses_accepting_instead_of_spinning() -> None:
    child = subprocess.Popen([sys.executable, "-c", OUT_OF_DESCRIPTORS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    crowd: list[socket.socket] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        port = int(child.stdout.readline())
        crowd = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
        child.stdin.write("go\n")
        child.stdin.flush()
        cpu, held = child.stdout.readline().split()
        assert float(cpu) < 0.3, f"{cpu} s of CPU in 2 s: the loop spins on a listener it cannot accept from"
        assert 0 < int(held) < 40
    finally:
        for sock in crowd:
            sock.close()
        child.kill()
        _, err = child.communicate(timeout=10)
    lines = [line for line in err.splitlines() if "cannot accept" in line]
    assert len(lines) == 1 and "Too many open files" in lines[0], err
