"""WAN emulation (DESIGN §7.6): two private network namespaces joined by one veth pair, shaped by tc.

    syncer namespace  10.213.<n>.1/30 ==veth== 10.213.<n>.2/30  learner namespace

Each end's egress is shaped by a qdisc (`netem rate R delay D loss L`, or `tbf rate R` when only a
rate is asked for), so both directions see the same link. Every process runs under
`ip netns exec`, so it can reach nothing but the other namespace (and its own loopback).

`support(kind)` probes, once per qdisc kind, whether this machine allows all of it (root, the `ip`
and `tc` tools, namespaces, veth pairs, the qdisc in the kernel) and returns the precise reason it
does not, or None. Tests skip with that reason. Teardown deletes both namespaces (which destroys
the veth pair) even when the test failed; every process is stopped first, by pid.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import LISTENING, Proc, Procs, Syncer, syncer_argv

TOOL_TIMEOUT_S = 20.0
PREFIX = "yeto-wan-"


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)


def _must(argv: Sequence[str]) -> None:
    done = _run(argv)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited with {done.returncode}: {done.stderr.strip()}")


@dataclass(frozen=True)
class Shape:
    """One direction of the emulated link (applied to both ends' egress)."""

    rate: str = "50mbit"
    delay: str | None = None  # e.g. "20ms"; needs netem
    loss: str | None = None  # e.g. "0.5%"; needs netem

    @property
    def kind(self) -> str:
        return "netem" if self.delay or self.loss else "tbf"

    def qdisc(self) -> list[str]:
        if self.kind == "netem":
            args = ["netem", "rate", self.rate]
            if self.delay:
                args += ["delay", self.delay]
            if self.loss:
                args += ["loss", self.loss]
            # netem's default queue (1000 packets) is fine for one bulk TCP flow per stream.
            return args
        return ["tbf", "rate", self.rate, "burst", "64kb", "latency", "200ms"]


class Link:
    """Two namespaces joined by a shaped veth pair; `close()` deletes everything it created."""

    def __init__(self, shape: Shape | None, subnet: int | None = None) -> None:
        tag = secrets.token_hex(3)
        self.syncer_ns = f"{PREFIX}s-{tag}"
        self.learner_ns = f"{PREFIX}l-{tag}"
        self.veth = (f"yw{tag}s", f"yw{tag}l")  # at most 15 characters each
        n = subnet if subnet is not None else secrets.randbelow(250) + 1
        self.syncer_ip, self.learner_ip = f"10.213.{n}.1", f"10.213.{n}.2"
        self.shape = shape
        self.created: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.syncer_ns, self.learner_ns):
            _must(["ip", "netns", "add", ns])
            self.created.append(ns)
        a, b = self.veth
        _must(["ip", "link", "add", a, "netns", self.syncer_ns, "type", "veth", "peer", "name", b,
               "netns", self.learner_ns])
        for ns, dev, ip in ((self.syncer_ns, a, self.syncer_ip), (self.learner_ns, b, self.learner_ip)):
            _must(["ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev])
            _must(["ip", "-n", ns, "link", "set", dev, "up"])
            _must(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.shape is not None:
                _must(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *self.shape.qdisc()])

    def qdiscs(self) -> str:
        out = []
        for ns, dev in ((self.syncer_ns, self.veth[0]), (self.learner_ns, self.veth[1])):
            out.append(_run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev]).stdout.strip())
        return "\n".join(out)

    def argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside namespace `ns` (ip execs it in place, so the pid is the command's own)."""
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        """Delete both namespaces (the veth pair goes with them); never raises."""
        for ns in reversed(self.created):
            with contextlib.suppress(Exception):
                _run(["ip", "netns", "del", ns])
        self.created.clear()

    def leftovers(self) -> list[str]:
        names = _run(["ip", "netns", "list"]).stdout.split()
        return [n for n in names if n in (self.syncer_ns, self.learner_ns)]


@functools.cache
def support(kind: str = "netem") -> str | None:
    """None when a shaped namespace pair with qdisc `kind` can be built here, else why not."""
    if os.geteuid() != 0:
        return f"WAN emulation needs root to create network namespaces (euid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"WAN emulation needs the `{tool}` tool (iproute2), which is not installed"
    shape = Shape(rate="50mbit", delay="20ms", loss="0.5%") if kind == "netem" else Shape(rate="50mbit")
    try:
        link = Link(shape, subnet=254)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot build a {kind}-shaped namespace pair: {exc}{_kernel_hint(kind)}"
    link.close()
    return None


def _kernel_hint(kind: str) -> str:
    """What the running kernel's config says about the qdisc, when it says anything."""
    option = {"netem": "CONFIG_NET_SCH_NETEM", "tbf": "CONFIG_NET_SCH_TBF"}[kind]
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        done = subprocess.run(["zcat", "/proc/config.gz"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                              check=False)
        if f"# {option} is not set" in done.stdout:
            return f" (the running kernel is built without {option})"
    return ""


def require(kind: str) -> None:
    reason = support(kind)
    if reason is not None:
        pytest.skip(reason)


@contextlib.contextmanager
def wan_link(procs: Procs, shape: Shape) -> Iterator[Link]:
    """A shaped link for one test; stops every process of `procs` before deleting the namespaces."""
    require(shape.kind)
    link = Link(shape)
    try:
        yield link
    finally:
        procs.close()
        link.close()
        assert not link.leftovers(), f"namespaces left behind: {link.leftovers()}"


def start_syncer_in(procs: Procs, link: Link, *, key_file: Path, timeout: float = 60.0, **kwargs: object) -> Syncer:
    """`python -m syncer` inside the syncer namespace, listening on its veth address."""
    tape, checkpoint = procs.workdir / "tape.jsonl", procs.workdir / "syncer.safetensors"
    argv = syncer_argv(key_file=key_file, checkpoint=checkpoint, tape=tape, **kwargs)  # type: ignore[arg-type]
    argv += ["--host", link.syncer_ip]  # the last --host wins
    proc = procs.start("syncer", link.argv(link.syncer_ns, argv))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.stdout().splitlines():
            m = LISTENING.match(line)
            if m:
                return Syncer(proc, m.group(1), int(m.group(2)), checkpoint, tape)
        if proc.poll() is not None:
            pytest.fail(f"syncer exited with {proc.poll()} before listening\n{proc.tail()}")
        time.sleep(0.05)
    pytest.fail(f"syncer did not print its listening line within {timeout:.0f} s\n{proc.tail()}")


def start_learner_in(procs: Procs, link: Link, argv: Sequence[str], name: str,
                     env: dict[str, str] | None = None) -> Proc:
    return procs.start(name, link.argv(link.learner_ns, argv), env=env)
