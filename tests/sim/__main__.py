"""`python -m tests.sim --seeds N` runs N seeded simulated runs and checks every invariant;
`--seed S` replays one, `--verbose` with the syncer's and learners' log lines."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tests.sim.runner import replay_command, run_seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__)
    parser.add_argument("--seeds", type=int, default=1000, help="how many seeds to run (from --first)")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, default=None, help="replay this one seed")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    parser.add_argument("--verbose", action="store_true", help="show the log lines of the replayed seed")
    args = parser.parse_args(argv)
    if args.seed is not None:
        args.first, args.seeds, args.workers = args.seed, 1, 1
        if args.verbose:
            logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    started = time.monotonic()
    failures = run_seeds(range(args.first, args.first + args.seeds), workers=args.workers, quiet=not args.verbose)
    took = time.monotonic() - started
    for seed, problems in failures:
        print(f"seed {seed}: " + "; ".join(problems))
        print(f"  replay: {replay_command(seed)}")
    print(f"{args.seeds} seeds in {took:.1f} s: {args.seeds - len(failures)} held every invariant, "
          f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
