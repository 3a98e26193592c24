"""The long run of the frame-decoder fuzz test (tests/unit/test_fuzz_frames.py runs a short one in CI).

    python -m benchmarks.fuzz --seconds 600
    python -m benchmarks.fuzz --seconds 30 --seed 7 --verbose

For `--seconds` it feeds random inputs through the same oracles as the unit test: mutated valid
frames (bit flips, inserted / deleted bytes, truncation, nasty values in length and count fields,
spliced bodies) and pure noise to parse_header + decode_body, one in `--stream-every` of them to
Stream.read_message over a socketpair, and random announce / chunk sequences to the Reassembler.
Only the protocol's own errors may escape, and allocation must stay within the bounds the oracles
check (tracemalloc). It prints inputs per second per target, and ends with the line
`fuzz: N inputs, K unexpected exceptions` (exit status 1 when K > 0).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import random
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_oracles() -> ModuleType:
    path = ROOT / "tests" / "unit" / "test_fuzz_frames.py"
    spec = importlib.util.spec_from_file_location("yeto_fuzz_oracles", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz (default 60)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    ap.add_argument("--stream-every", type=int, default=10, help="one input in N also goes through a socketpair")
    ap.add_argument("--reassembler-every", type=int, default=5, help="one reassembler sequence per N inputs")
    ap.add_argument("--verbose", action="store_true", help="print every unexpected exception in full")
    args = ap.parse_args(argv)

    fz = load_oracles()
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    rng = random.Random(seed)
    print(f"fuzz: seed {seed}, {args.seconds:g} s")
    counts: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []

    def run(target: str, fn, *a) -> None:  # type: ignore[no-untyped-def]
        try:
            outcomes[f"{target}: {fn(*a)}" if target != "reassembler" else target] += 1
        except fz.Unexpected as exc:
            failures.append(f"{target}: {exc}")
            if args.verbose or len(failures) <= 5:
                print(f"UNEXPECTED {target}: {str(exc)[:2000]}", flush=True)
        counts[target] += 1

    start = time.monotonic()
    deadline = start + args.seconds
    last_report = start
    i = 0
    while time.monotonic() < deadline:
        i += 1
        data = fz.random_input(rng)
        run("decode", fz.check_decode, data)
        if i % args.stream_every == 0:
            run("stream", fz.check_stream, data, rng.choice((64 * 1024, fz.MAX_CONTROL_BODY)))
        if i % args.reassembler_every == 0:
            run("reassembler", fz.check_reassembler, fz.random_reassembler_ops(rng))
        now = time.monotonic()
        if now - last_report >= 10:
            last_report = now
            total = sum(counts.values())
            print(f"  {now - start:6.0f} s  {total} inputs  {total / (now - start):.0f}/s  "
                  f"{len(failures)} unexpected", flush=True)

    elapsed = time.monotonic() - start
    for target in sorted(counts):
        print(f"{target:12s} {counts[target]:9d} inputs  {counts[target] / elapsed:9.0f}/s")
    for outcome, n in sorted(outcomes.items()):
        print(f"  {outcome}: {n}")
    total = sum(counts.values())
    print(f"fuzz: {total} inputs, {len(failures)} unexpected exceptions")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
