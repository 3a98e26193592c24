"""What `yeto-plot` keeps of an event tape: one streaming pass, in memory bounded whatever its length.

The tape is read once, a line at a time (`tape_lines`), and `Account` keeps only what the five
pictures need, so a week-long run is drawn from as many points as a ten-minute one (900-pixel
pictures could not show more):

* each series (a learner's weights, a fragment's merge times, ...) is a `Series` of at most
  ``POINTS`` points; when it fills up, neighbouring points merge pairwise (x and y averaged, the
  lowest and highest y kept, drawn as a band) and each later point stands for twice as many records;
* the round timeline keeps at most ``POINTS`` `Bars` per fragment: two neighbouring bars merge
  into one spanning both, with their total grace and the time their rounds were open;
* throughput is counted in at most ``POINTS`` `Rates` bins that double in width as the run grows;
* the first ``MAX_SERIES`` learners and fragments get a series each, the rest share one;
* at most ``MAX_LAUNCHES`` launched rounds wait for their commit (the oldest is dropped first).

Bad input raises PlotError naming the tape and its line: a line longer than ``MAX_LINE_BYTES``
(refused before it is parsed), one that is not a JSON object or is nested past Python's
recursion limit, NaN or Infinity anywhere, a record without "event" and "t", and a launch or
commit record whose fields the plots use have the wrong types or values out of bounds (1e999
reads as infinity: out of bounds). So are a tape that is missing, not a regular file or
unreadable, and one without a commit. A torn last line is skipped, as everywhere; fields the
plots do not use are not looked at.
"""

from __future__ import annotations

import json
import math
import stat
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

POINTS = 1024  # per series (even: full series halve); more than a 900-pixel picture has columns
MAX_SERIES = 32  # learners and fragments with a series of their own; the rest share one
OTHERS = -1  # the key of that shared series
MAX_LAUNCHES = 4096  # launched rounds waiting for their commit (a pipeline holds a few)
MAX_LINE_BYTES = 1 << 20  # a commit record of 1,000 learners is ~100 KiB
MAX_T = 1e11  # "t", unix seconds: past the year 5000 it is damage, not a time
MAX_VALUE = 1e15  # no count, weight, norm or duration on a tape comes near it


class PlotError(ValueError):
    """The tape cannot be plotted (one line for the user)."""


class BadRecord(ValueError):
    """A record of the tape that the plots cannot use; the reader adds where it is."""


class Foreign(BadRecord):
    """A record without "event" and "t": the file is not a yeto event tape."""


# ---- bounded series -------------------------------------------------------------------------------


class Series:
    """At most `POINTS` (x, y) points of a stream of any length: full, neighbouring points merge
    pairwise and each later point is the mean of twice as many raw ones (`stride`); `lo` and `hi`
    keep the smallest and largest raw y behind each point."""

    __slots__ = ("_hi", "_lo", "_n", "_sx", "_sy", "count", "hi", "lo", "stride", "x", "y")

    def __init__(self) -> None:
        self.x, self.y, self.lo, self.hi = array("d"), array("d"), array("d"), array("d")
        self.stride = 1  # raw points per kept point
        self.count = 0  # raw points seen
        self._n, self._sx, self._sy, self._lo, self._hi = 0, 0.0, 0.0, math.inf, -math.inf

    def add(self, x: float, y: float) -> None:
        self.count += 1
        self._n += 1
        self._sx += x
        self._sy += y
        if y < self._lo:
            self._lo = y
        if y > self._hi:
            self._hi = y
        if self._n == self.stride:
            self._emit()
            if len(self.x) == POINTS:
                self._halve()

    def _emit(self) -> None:
        n = self._n
        self.x.append(self._sx / n)
        self.y.append(self._sy / n)
        self.lo.append(self._lo)
        self.hi.append(self._hi)
        self._n, self._sx, self._sy, self._lo, self._hi = 0, 0.0, 0.0, math.inf, -math.inf

    def _halve(self) -> None:
        x, y, lo, hi = self.x, self.y, self.lo, self.hi
        self.x = array("d", ((x[i] + x[i + 1]) / 2 for i in range(0, len(x), 2)))
        self.y = array("d", ((y[i] + y[i + 1]) / 2 for i in range(0, len(y), 2)))
        self.lo = array("d", (min(lo[i], lo[i + 1]) for i in range(0, len(lo), 2)))
        self.hi = array("d", (max(hi[i], hi[i + 1]) for i in range(0, len(hi), 2)))
        self.stride *= 2

    def points(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """x, y, lo, hi of every kept point, the partly filled last one included."""
        x, y, lo, hi = list(self.x), list(self.y), list(self.lo), list(self.hi)
        if self._n:
            x.append(self._sx / self._n)
            y.append(self._sy / self._n)
            lo.append(self._lo)
            hi.append(self._hi)
        return x, y, lo, hi


class Bars:
    """At most `POINTS` bars (start, end, grace, busy) of a fragment's rounds: full, neighbouring
    bars merge into one from the first start to the second end, with their total grace and total
    busy time (the seconds their rounds were open, which the picture shows as the bar's opacity)."""

    __slots__ = ("_busy", "_end", "_grace", "_n", "_start", "busy", "end", "grace", "start", "stride")

    def __init__(self) -> None:
        self.start, self.end, self.grace, self.busy = array("d"), array("d"), array("d"), array("d")
        self.stride = 1
        self._n, self._start, self._end, self._grace, self._busy = 0, 0.0, 0.0, 0.0, 0.0

    def add(self, start: float, end: float, grace: float) -> None:
        if not self._n:
            self._start = start
        self._n += 1
        self._end = end
        self._grace += grace
        self._busy += max(end - start, 0.0)
        if self._n == self.stride:
            self.start.append(self._start)
            self.end.append(self._end)
            self.grace.append(self._grace)
            self.busy.append(self._busy)
            self._n, self._grace, self._busy = 0, 0.0, 0.0
            if len(self.start) == POINTS:
                s, e, g, u = self.start, self.end, self.grace, self.busy
                self.start = array("d", s[0::2])
                self.end = array("d", e[1::2])
                self.grace = array("d", (g[i] + g[i + 1] for i in range(0, len(g), 2)))
                self.busy = array("d", (u[i] + u[i + 1] for i in range(0, len(u), 2)))
                self.stride *= 2

    def bars(self) -> list[tuple[float, float, float, float]]:
        """(start, end, grace, busy) of every kept bar, the partly filled last one included."""
        out = list(zip(self.start, self.end, self.grace, self.busy, strict=True))
        if self._n:
            out.append((self._start, self._end, self._grace, self._busy))
        return out


class Rates:
    """Commits and merged tokens counted in at most `POINTS` time bins from the first commit; a
    commit past the last bin doubles every bin's width (neighbours merge) until it fits."""

    def __init__(self) -> None:
        self.origin: float | None = None
        self.last = 0.0
        self.width = 1e-3  # seconds per bin
        self.commits, self.tokens = array("d"), array("d")

    def add(self, t: float, tokens: float) -> None:
        if self.origin is None:
            self.origin = t
        self.last = max(self.last, t)
        i = max(0, int((t - self.origin) / self.width))
        while i >= POINTS:
            self.commits = array("d", (sum(self.commits[j:j + 2]) for j in range(0, len(self.commits), 2)))
            self.tokens = array("d", (sum(self.tokens[j:j + 2]) for j in range(0, len(self.tokens), 2)))
            self.width *= 2
            i = max(0, int((t - self.origin) / self.width))
        if i >= len(self.commits):
            grow = i + 1 - len(self.commits)
            self.commits.extend([0.0] * grow)
            self.tokens.extend([0.0] * grow)
        self.commits[i] += 1
        self.tokens[i] += tokens

    def windows(self, count: int = 20) -> tuple[list[float], list[float], list[float]]:
        """About `count` windows of whole bins: their centres (seconds from the origin), rounds per
        minute and tokens per second. The last ends at the last commit; one shorter than half a
        window joins the window before it."""
        n, w = len(self.commits), self.width
        k = max(1, math.ceil(n / count))
        starts = list(range(0, n, k))
        if len(starts) > 1 and n - starts[-1] < k / 2:
            starts.pop()
        assert self.origin is not None
        centres, rounds, tokens = [], [], []
        for i, g in enumerate(starts):
            stop = starts[i + 1] if i + 1 < len(starts) else n
            span = (stop - g) * w if i + 1 < len(starts) else max(self.last - self.origin - g * w, w)
            centres.append(g * w + span / 2)
            rounds.append(sum(self.commits[g:stop]) * 60.0 / span)
            tokens.append(sum(self.tokens[g:stop]) / span)
        return centres, rounds, tokens


def slot(series: dict[int, Any], key: int) -> int:
    """The key `key`'s points go under: itself, or past `MAX_SERIES` keys the shared `OTHERS`."""
    if key in series or len(series) - (OTHERS in series) < MAX_SERIES:
        return key
    return OTHERS


def series_of(series: dict[int, Any], key: int, make: Callable[[], Any]) -> Any:
    """The series `key`'s points go into (`slot`), made on first use."""
    found = series.get(key)
    if found is None:
        key = slot(series, key)
        found = series.get(key)
        if found is None:
            found = series[key] = make()
    return found


# ---- reading the tape --------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(record: dict[str, Any], key: str, *, lo: float = 0.0, hi: float = MAX_VALUE,
            default: float | None = None) -> float | None:
    value = record.get(key)
    if value is None:
        return default
    if not _is_number(value) or not lo <= value <= hi:
        raise BadRecord(f"{record['event']} field {key!r} must be a number in [{lo:g}, {hi:g}], not {_shown(value)}")
    return float(value)


def _integer(record: dict[str, Any], key: str) -> int | None:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_VALUE:
        raise BadRecord(f"{record['event']} field {key!r} must be an integer in [0, {MAX_VALUE:g}], "
                        f"not {_shown(value)}")
    return value


def _count(record: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer field; without a default, one the record must have."""
    value = _integer(record, key)
    if value is not None:
        return value
    if default is None:
        raise BadRecord(f"{record['event']} record has no {key!r}")
    return default


_INTEGER, _NUMBER = frozenset({int}), frozenset({int, float})


def _numbers(record: dict[str, Any], key: str, *, lo: float = 0.0, integers: bool = False) -> list[Any]:
    values = record.get(key)
    if values is None:
        return []
    kind = "integers" if integers else "numbers"
    if not isinstance(values, list):
        raise BadRecord(f"{record['event']} field {key!r} must be a list of {kind}, not {_shown(values)}")
    # the common case in C: exact types (a bool is not a number here), then the bounds
    types = _INTEGER if integers else _NUMBER
    if values and not (set(map(type, values)) <= types and lo <= min(values) and max(values) <= MAX_VALUE):
        wrong = next(v for v in values if type(v) not in types or not lo <= v <= MAX_VALUE)
        raise BadRecord(f"{record['event']} field {key!r} must be a list of {kind} in [{lo:g}, {MAX_VALUE:g}], "
                        f"not one holding {_shown(wrong)}")
    return values


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a tape records")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def parse_line(raw: bytes) -> Any:
    """One tape line as JSON, refusing NaN and Infinity (a number too large for a float, 1e999, reads
    as inf, which every field the plots use refuses by its bounds)."""
    return _DECODER.decode(raw.decode("utf-8"))


def tape_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each record of the tape at `path`, one line in memory at a time;
    a torn last line is skipped, anything else that is not a record raises PlotError."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise PlotError(f"event tape {path} does not exist") from None
    except OSError as exc:
        raise PlotError(f"event tape {path}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise PlotError(f"event tape {path} is not a regular file")
    try:
        with path.open("rb") as f:
            number = 0
            while raw := f.readline(MAX_LINE_BYTES + 1):
                number += 1
                torn = not raw.endswith(b"\n")
                if torn and len(raw) > MAX_LINE_BYTES:
                    raise PlotError(f"event tape {path} line {number} is longer than {MAX_LINE_BYTES} bytes: "
                                    "not a tape record")
                if not raw.strip():
                    continue
                try:
                    record = parse_line(raw)
                    if not isinstance(record, dict):
                        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                except (ValueError, RecursionError) as exc:
                    if torn:  # no newline after it: a write a crash cut short
                        return
                    why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                    raise PlotError(f"event tape {path} line {number} is corrupt: {why}") from None
                yield number, record
    except OSError as exc:
        raise PlotError(f"event tape {path}: cannot read it ({exc.strerror})") from None


class Account:
    """What the six pictures need of a tape, in memory bounded whatever its length."""

    def __init__(self) -> None:
        self.start = math.inf  # the tape's first record time
        self.commits = 0
        self.launched: dict[tuple[int, int | None], float] = {}  # insertion order: the oldest first
        self.bars: dict[int, Bars] = {}
        self.merge_ms: dict[int, Series] = {}
        self.merged_tokens: dict[int, Series] = {}
        self.token_totals: dict[int, float] = {}
        self.weights: dict[int, Series] = {}
        self.lag: dict[int, Series] = {}
        self.carried = Series()
        self.js = Series()
        self.l2 = Series()
        self.rates = Rates()
        self.bits_up = Series()  # per commit, bits per parameter of a merged push
        self.bits_down = Series()  # ... and of its broadcast to one learner
        self.bytes_up = Series()  # the payload bytes moved so far each way, in GB, against seconds
        self.bytes_down = Series()
        self._moved = [0.0, 0.0]

    def add(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if not isinstance(event, str) or "t" not in record:
            raise Foreign("has no 'event' and 't'")
        t = _number(record, "t", hi=MAX_T)
        if t is None:
            raise BadRecord(f"{event} field 't' must be unix seconds, not None")
        self.start = min(self.start, t)
        if event == "commit":
            self._commit(record, t)
        elif event == "launch":
            key = (_count(record, "round"), _integer(record, "attempt"))
            self.launched.pop(key, None)
            self.launched[key] = t
            if len(self.launched) > MAX_LAUNCHES:  # a round that was never committed
                del self.launched[next(iter(self.launched))]
        elif event == "carry":
            self.carried.add(t, self.carried.count + 1)

    def _commit(self, c: dict[str, Any], t: float) -> None:
        rnd, attempt = _count(c, "round"), _integer(c, "attempt")
        fragment, version = _count(c, "fragment", 0), _count(c, "version", 1)
        grace = (_number(c, "grace_ms", default=0.0) or 0.0) / 1000.0
        wait = (_number(c, "wait_ms", default=0.0) or 0.0) / 1000.0
        merge_ms = _number(c, "merge_ms", default=0.0) or 0.0
        js = _number(c, "consensus_js")
        learners = _numbers(c, "learners", integers=True)
        tokens = _numbers(c, "tokens")
        weights = _numbers(c, "weights", lo=-MAX_VALUE)
        bases = _numbers(c, "base_versions", integers=True)
        norms = _numbers(c, "delta_norms")
        self.commits += 1
        began = self.launched.pop((rnd, attempt), t - wait - grace)
        series_of(self.bars, fragment, Bars).add(began, t, grace)
        merges = series_of(self.merge_ms, fragment, Series)
        merges.add(merges.count, merge_ms)  # x: the commit's index among its fragment's
        for lid, n in zip(learners, tokens, strict=False):
            key = slot(self.merged_tokens, lid)
            self.token_totals[key] = self.token_totals.get(key, 0.0) + n
            series_of(self.merged_tokens, key, Series).add(t, self.token_totals[key])
        for lid, w in zip(learners, weights, strict=False):
            series_of(self.weights, lid, Series).add(rnd, w)
        for lid, base in zip(learners, bases, strict=False):
            series_of(self.lag, lid, Series).add(rnd, version - 1 - base)
        if js is not None:
            self.js.add(rnd, js)
        if norms:
            self.l2.add(rnd, sum(norms) / len(norms))
        self.rates.add(t, sum(tokens))
        self._wire(c, t, rnd, len(learners))

    def _wire(self, c: dict[str, Any], t: float, rnd: int, pushes: int) -> None:
        """A commit's bytes each way (absent on a tape written before they were kept)."""
        up, down, numel = _number(c, "bytes_in"), _number(c, "bytes_out"), _number(c, "numel")
        receivers = _number(c, "receivers")
        if up is None or down is None or not numel or receivers is None:
            return
        if pushes:
            self.bits_up.add(rnd, 8 * up / numel / pushes)
        if receivers:
            self.bits_down.add(rnd, 8 * down / numel / receivers)
        self._moved[0] += up / 1e9
        self._moved[1] += down / 1e9
        self.bytes_up.add(t - self.start, self._moved[0])
        self.bytes_down.add(t - self.start, self._moved[1])


def read_account(path: Path) -> Account:
    """The tape at `path` in one streaming pass; a PlotError names the line that cannot be used."""
    account = Account()
    for number, record in tape_lines(path):
        try:
            account.add(record)
        except Foreign as exc:
            raise PlotError(f"{path} is not a yeto event tape: line {number} {exc} ({_shown(record)})") from None
        except BadRecord as exc:
            raise PlotError(f"event tape {path} line {number}: {exc}") from None
    if not account.commits:
        raise PlotError(f"{path} holds no committed round yet: nothing to plot")
    return account
