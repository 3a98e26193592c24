"""One isotropic-merge worker process (`python -m syncer.merge.iso_worker --device cuda:3`).

The syncer's `IsoPool` starts one per device of `--iso-worker-devices` and talks to it over its
stdin and stdout: a job is one float32 matrix, the answer is that matrix with a flat spectrum
(`syncer.merge.iso.isotropic_`) or an error text. The frames (little-endian):

    worker → syncer, once:   b"ISO1" u32 len, the device it runs on (utf-8): ready
    syncer → worker:         u64 job, u32 rows, u32 cols, rows·cols float32
    worker → syncer:         u64 job, u8 status (0 ok, 1 error), u64 n, n bytes (the matrix, or the error)

The worker ends at end of input: when the syncer closes the pipe or dies, so a killed syncer
never leaves a worker behind. It runs in a session of its own, so a terminal's Ctrl-C reaches the
syncer, which stops its workers itself. Its fault points (`iso-start`, `iso-job`) are armed by
the `--fault` the pool passes on (`yeto_core.faults`).
"""

from __future__ import annotations

import argparse
import struct
import sys
from typing import BinaryIO

READY = b"ISO1"
JOB = struct.Struct("<QII")
ANSWER = struct.Struct("<QBQ")
OK, FAILED = 0, 1


def read_exact(stream: BinaryIO, n: int) -> bytes | None:
    """`n` bytes, or None at end of input (a clean end only between frames)."""
    if n == 0:
        return b""
    data = stream.read(n)
    if not data:
        return None
    if len(data) != n:
        raise EOFError(f"input ended inside a frame ({len(data)} of {n} bytes)")
    return data


def serve(device_name: str, threads: int, fault: str, stdin: BinaryIO, stdout: BinaryIO) -> int:
    import torch  # here, not at import: the pool's parent imports this module's constants only

    from syncer.merge.iso import isotropic_
    from yeto_core.codecs import tensor_bytes
    from yeto_core.faults import FaultInjector

    faults = FaultInjector(fault)
    torch.set_num_threads(threads)
    faults.point("iso-start")
    device = torch.device(device_name)
    torch.zeros(1, device=device).add_(1)  # a CUDA context now, so the start-up deadline covers it
    name = str(device).encode()
    stdout.write(READY + struct.pack("<I", len(name)) + name)
    stdout.flush()
    while True:
        head = read_exact(stdin, JOB.size)
        if head is None:
            return 0
        job, rows, cols = JOB.unpack(head)
        body = read_exact(stdin, rows * cols * 4)
        if body is None:
            raise EOFError("input ended inside a job")
        faults.point("iso-job")
        try:
            host = (torch.frombuffer(bytearray(body), dtype=torch.float32).view(rows, cols) if body
                    else torch.empty(rows, cols))
            result = isotropic_(host.to(device)).cpu()
            out = tensor_bytes(result)
            stdout.write(ANSWER.pack(job, OK, out.nbytes))
            stdout.write(out)
        except Exception as exc:  # the pool names this worker, its device and the matrix
            text = f"{type(exc).__name__}: {exc}".encode()
            stdout.write(ANSWER.pack(job, FAILED, len(text)) + text)
        stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m syncer.merge.iso_worker")
    p.add_argument("--device", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fault", default="")
    args = p.parse_args(argv)
    try:
        return serve(args.device, args.threads, args.fault, sys.stdin.buffer, sys.stdout.buffer)
    except (BrokenPipeError, EOFError):
        return 0  # the syncer went away mid-frame: nothing to answer
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
