"""A stand-in for ACCL's `cclo_emu` binary, with its command line: rank `-r` of a world
of `-s` answers on port `-p` + rank with the fake command server of
tests/test_emulator_protocol.py (memory, nop and copy; no network between ranks), until
killed. For tests of what starts emulators (AACCL_EMULATOR)."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

from test_emulator_protocol import FakeEmulator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-s", type=int, required=True, help="world size")
    parser.add_argument("-r", type=int, required=True, help="rank")
    parser.add_argument("-p", type=int, required=True, help="start port")
    parser.add_argument("-c", choices=["tcp", "udp", "cyt_rdma"], default="tcp",
                        help="network stack")
    parser.add_argument("-l", type=int, default=0, help="log level")
    parser.add_argument("-b", action="store_true", help="kernel stream loopback")
    parser.add_argument("--tag", help="not cclo_emu's: a name to find these processes by")
    args = parser.parse_args()
    assert 0 <= args.r < args.s
    if args.tag:  # what it was started with, for the test to check
        Path(args.tag, f"stack.{args.r}").write_text(args.c)
    FakeEmulator(port=args.p + args.r)
    print(f"fake cclo_emu rank {args.r} of {args.s} at port {args.p + args.r}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
