"""Compress a file into a standard LZ4 frame with compute kernels on the soft CCLO.

Usage::

    python examples/lz4_frame.py INPUT OUTPUT [--generate SIZE] [--brick N]
                                 [--no-overlap] [--repeat R]

    python examples/lz4_frame.py data.txt data.txt.lz4 --generate 64M   # make data, run
    lz4 -d data.txt.lz4  (or lz4.frame.decompress) reads the result

The input goes through the device in *bricks* of N (default 8) 1 MiB blocks. A
brick is one chain of calls, so it costs one ``await``: a host->device transfer, a
Python kernel per block calling ``lz4.block.compress`` (which releases the GIL, so a
brick's kernels run in parallel on the device's workers; each is given only its own
block's input and output slot, as calls that share device memory run in turn), and
one device->host transfer of the brick's slots (each block's size is in its header,
so the host writes just that much). Three sets of buffers keep two bricks in
flight: brick i+1 is read, uploaded and queued while brick i compresses and the
host writes brick i-1 to OUTPUT. A brick's kernels wait for the previous brick's
kernels, so bricks compress in turn while the previous one downloads.

By default three runs are timed, interleaved, best of R: the overlapped pipeline,
the same work done one block at a time (read, upload, compress, download, write:
each awaited) and single-threaded ``lz4.frame.compress`` with the same frame
parameters. Each run reads INPUT (from the page cache) and ends with the complete
frame written to a file (OUTPUT for the pipelines, a temporary file next to it for
``lz4.frame``); device buffers are allocated before the clock starts.
``--no-overlap`` skips the overlapped run. Every pipeline run's OUTPUT is read back
and checked with ``lz4.frame.decompress``; the exit status is 1 if a round trip
fails.

``--generate SIZE`` (``64M``, ``1G``, ``300k``) first writes INPUT: text-like
random words, which LZ4 shrinks to about half.

The frame (https://github.com/lz4/lz4/blob/dev/doc/lz4_Frame_format.md): magic
number, a descriptor (version 01, independent blocks, content size, 1 MiB blocks)
and its header checksum, blocks each behind a 4-byte size (high bit set: stored
uncompressed, when compressing does not shrink it), and the end mark. No block or
content checksums: xxHash is not in the ``lz4`` package, and the header's checksum
is a few bytes that pure Python hashes in no time.
"""

from __future__ import annotations

import argparse
import io
import os
import struct
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import lz4.block
import lz4.frame
import numpy as np

import aaccl

BLOCK = 1 << 20  # the frame's block maximum size (BD code 6)
MAGIC = 0x184D2204
STORED = 1 << 31  # a block size's high bit: the block is stored uncompressed
END_MARK = b"\x00\x00\x00\x00"
SLOT = 4 + BLOCK  # a compressed block in device memory: its 4-byte size, then its data
SETS = 3  # buffer sets of the overlapped pipeline: SETS - 1 bricks in flight

# -- xxHash32: only for the frame's header checksum (a handful of bytes) ----------------

_P1, _P2, _P3, _P4, _P5 = 2654435761, 2246822519, 3266489917, 668265263, 374761393
_M = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M


def xxh32(data: bytes, seed: int = 0) -> int:
    """XXH32 of `data` (reference algorithm, pure Python: meant for short inputs)."""
    n, i = len(data), 0
    if n >= 16:
        v = [(seed + _P1 + _P2) & _M, (seed + _P2) & _M, seed & _M, (seed - _P1) & _M]
        while i + 16 <= n:
            for lane in range(4):
                word = int.from_bytes(data[i:i + 4], "little")
                v[lane] = (_rotl((v[lane] + word * _P2) & _M, 13) * _P1) & _M
                i += 4
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M
    else:
        h = (seed + _P5) & _M
    h = (h + n) & _M
    while i + 4 <= n:
        h = (h + int.from_bytes(data[i:i + 4], "little") * _P3) & _M
        h = (_rotl(h, 17) * _P4) & _M
        i += 4
    while i < n:
        h = (h + data[i] * _P5) & _M
        h = (_rotl(h, 11) * _P1) & _M
        i += 1
    h = ((h ^ (h >> 15)) * _P2) & _M
    h = ((h ^ (h >> 13)) * _P3) & _M
    return h ^ (h >> 16)


# -- the frame format ---------------------------------------------------------------------

def frame_header(content_size: int | None = None) -> bytes:
    """Magic number, frame descriptor and header checksum: version 01, independent
    blocks, no checksums, 1 MiB blocks, and the content size when given (so the
    reader can check it)."""
    flg = 0b0110_0000 | (0b1000 if content_size is not None else 0)  # version, B.Indep, C.Size
    descriptor = bytes([flg, 6 << 4])  # BD: block maximum size code 6 = 1 MiB
    if content_size is not None:
        descriptor += struct.pack("<Q", content_size)
    checksum = (xxh32(descriptor) >> 8) & 0xFF
    return struct.pack("<I", MAGIC) + descriptor + bytes([checksum])


def block_header(size: int, stored: bool) -> bytes:
    """The 4-byte little-endian size in front of a block's data."""
    if not 0 <= size <= BLOCK:
        raise ValueError(f"a block holds 0..{BLOCK} bytes, not {size}")
    return struct.pack("<I", size | (STORED if stored else 0))


def block_length(header: bytes | memoryview | np.ndarray) -> int:
    """How many data bytes follow a block header."""
    return int.from_bytes(bytes(header[:4]), "little") & ~STORED


def compress_block(src: np.ndarray, dst: np.ndarray) -> int:
    """Write one frame block (header, then data) for the bytes `src` into `dst`
    (`SLOT` bytes) and return its length. LZ4 releases the GIL, so blocks compress in
    parallel; the compressed bytes are copied once, straight into `dst`."""
    packed = lz4.block.compress(src, store_size=False)
    n = len(packed)
    if n < src.nbytes:
        dst[4:4 + n] = np.frombuffer(packed, np.uint8)
        header = block_header(n, stored=False)
    else:  # incompressible: store it
        n = src.nbytes
        dst[4:4 + n] = src
        header = block_header(n, stored=True)
    dst[:4] = np.frombuffer(header, np.uint8)
    return 4 + n


def compress_frame(data: bytes) -> bytes:
    """The whole frame, compressed on the host alone: what the pipelines' frames must
    equal byte for byte (LZ4 is deterministic)."""
    out = io.BytesIO()
    out.write(frame_header(len(data)))
    slot = np.empty(SLOT, np.uint8)
    source = np.frombuffer(data, np.uint8)
    for start in range(0, len(data), BLOCK):
        length = compress_block(source[start:start + BLOCK], slot)
        out.write(slot[:length].data)
    out.write(END_MARK)
    return out.getvalue()


def bricks(size: int, brick: int) -> Iterator[tuple[int, int]]:
    """The [lo, hi) byte ranges of the bricks of `size` bytes."""
    step = brick * BLOCK
    for lo in range(0, size, step):
        yield lo, min(size, lo + step)


# -- the pipeline on the soft CCLO ----------------------------------------------------------

class Slots:
    """One brick's device buffers (each with its host twin): the input blocks and,
    per block, a `SLOT` for its header and compressed data. The per-block views are
    made once: a view finds its device address on first use, which costs
    microseconds."""

    def __init__(self, accl: aaccl.ACCL, brick: int) -> None:
        self.src = accl.allocate(brick * BLOCK, np.uint8)
        self.dst = accl.allocate(brick * SLOT, np.uint8)
        self._blocks = [(self.src[j * BLOCK:(j + 1) * BLOCK], self.dst[j * SLOT:(j + 1) * SLOT])
                        for j in range(brick)]

    async def touch(self, accl: aaccl.ACCL) -> None:
        """Write both copies of every buffer once: fresh memory is mapped on first
        write, and those page faults are part of allocating, not of compressing."""
        for buf in (self.src, self.dst):
            buf.fill(0)
            await accl.sync_to_device(buf)

    def read_input(self, source: BinaryIO, nbytes: int) -> None:
        """Read the brick's input from the file straight into the host buffer."""
        if source.readinto(self.src[:nbytes].data) != nbytes:
            raise EOFError("the input file is shorter than it was")

    def block(self, j: int, nbytes: int = BLOCK) -> tuple[aaccl.Buffer, aaccl.Buffer]:
        """Block j's input (its first `nbytes` bytes) and its output slot: each kernel
        gets only the memory it touches, since calls that share device memory run in
        turn (results as if in order), and a kernel may write all of every buffer it
        is passed."""
        src, dst = self._blocks[j]
        return (src if nbytes == BLOCK else src[:nbytes]), dst

    def write_out(self, nblocks: int, out: BinaryIO) -> None:
        """Write the brick's blocks, from host memory, to `out`: each slot's header
        says how many of its bytes are the block's."""
        for j in range(nblocks):
            slot = self._blocks[j][1]
            out.write(slot[:4 + block_length(slot)].data)


def submit_brick(accl: aaccl.ACCL, kernel: aaccl.Kernel, slots: Slots, nbytes: int,
                 after: Sequence[aaccl.Call] = ()) -> tuple[aaccl.Call, list[aaccl.Call]]:
    """Upload, compress and download one brick of `nbytes` input bytes (already in
    `slots.src`'s host memory) as one chain: one upload, a kernel per block (they run
    in parallel) and one download of all their slots, each slot whole, unused tail
    and all (the block's size is in its header: copying more on a worker costs less
    than a round trip through the host to learn the sizes first). The kernels start
    once the previous brick's kernels (`after`) are done, so bricks compress one after
    the other while the previous brick downloads; the upload need not wait.
    Returns the chain's last call (the download) and the kernels."""
    up = accl.sync_to_device(slots.src[:nbytes])
    packed = [kernel(*slots.block(j, min(BLOCK, nbytes - start)), waitfor=[up, *after])
              for j, start in enumerate(range(0, nbytes, BLOCK))]
    return accl.sync_from_device(slots.dst[:len(packed) * SLOT], waitfor=packed), packed


@dataclass
class Timing:
    """Wall-clock and CPU seconds (the process's, every thread's) of one run."""

    wall: float
    cpu: float


class Stopwatch:
    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self) -> Timing:
        return Timing(time.perf_counter() - self._wall, time.process_time() - self._cpu)


async def pipeline(accl: aaccl.ACCL, source: BinaryIO, size: int, out: BinaryIO,
                   brick: int) -> Timing:
    """Overlapped: two bricks in flight (three sets of buffers, used in turn): brick
    i+1 is read, uploaded and queued while brick i compresses and the host writes
    brick i-1 out."""
    kernel = accl.kernel(compress_block, name="lz4")
    sets = [Slots(accl, brick) for _ in range(SETS)]
    for slots in sets:
        await slots.touch(accl)
    clock = Stopwatch()
    out.write(frame_header(size))
    in_flight: deque[tuple[Slots, aaccl.Call, int]] = deque()
    packed: list[aaccl.Call] = []
    for i, (lo, hi) in enumerate(bricks(size, brick)):
        if len(in_flight) == len(sets) - 1:
            await _write_brick(*in_flight.popleft(), out)
        slots = sets[i % len(sets)]  # its last brick, i - SETS, was written out already
        slots.read_input(source, hi - lo)
        compressed, packed = submit_brick(accl, kernel, slots, hi - lo, packed)
        in_flight.append((slots, compressed, len(packed)))
    while in_flight:
        await _write_brick(*in_flight.popleft(), out)
    out.write(END_MARK)
    out.flush()
    return clock.stop()


async def _write_brick(slots: Slots, compressed: aaccl.Call, nblocks: int,
                       out: BinaryIO) -> None:
    await compressed
    slots.write_out(nblocks, out)


async def sequential(accl: aaccl.ACCL, source: BinaryIO, size: int, out: BinaryIO,
                     brick: int) -> Timing:
    """The same work one block at a time, each call awaited before the next: nothing
    overlaps (the baseline; `brick` is unused)."""
    kernel = accl.kernel(compress_block, name="lz4")
    slots = Slots(accl, 1)
    await slots.touch(accl)
    clock = Stopwatch()
    out.write(frame_header(size))
    for lo in range(0, size, BLOCK):
        n = min(BLOCK, size - lo)
        src, dst = slots.block(0, n)
        slots.read_input(source, n)
        await accl.sync_to_device(src)
        await kernel(src, dst)
        await accl.sync_from_device(dst)
        slots.write_out(1, out)
    out.write(END_MARK)
    out.flush()
    return clock.stop()


Runner = Callable[[aaccl.ACCL, BinaryIO, int, BinaryIO, int], Awaitable[Timing]]


def run_pipeline(runner: Runner, input: str, output: str, brick: int) -> Timing:
    """Run one pipeline on a one-rank soft CCLO, from `input` to `output`."""
    with open(input, "rb", buffering=0) as source, open(output, "wb") as out:
        async def main(accl: aaccl.ACCL) -> Timing:
            return await runner(accl, source, os.fstat(source.fileno()).st_size, out, brick)
        return aaccl.run(main, world_size=1)[0]


def run_reference(input: str, directory: str) -> Timing:
    """Single-threaded lz4.frame.compress with the same frame parameters, from `input`
    to a temporary file."""
    with tempfile.TemporaryFile(dir=directory or None) as out:
        clock = Stopwatch()
        with open(input, "rb", buffering=0) as source:
            data = source.read()
        out.write(lz4.frame.compress(data, block_size=lz4.frame.BLOCKSIZE_MAX1MB,
                                     block_linked=False, store_size=True))
        out.flush()
        return clock.stop()


def round_trip_ok(data: bytes, output: str) -> bool:
    with open(output, "rb") as f:
        return lz4.frame.decompress(f.read()) == data


# -- test data and the command line ----------------------------------------------------------

def text_like(size: int, seed: int = 0) -> bytes:
    """`size` bytes of random lowercase words, Zipf-distributed over a large
    vocabulary: LZ4 compresses it to about half, at roughly its speed on text."""
    rng = np.random.default_rng(seed)
    vocabulary = 1 << 18
    lengths = rng.integers(2, 12, size=vocabulary)  # each word with its trailing space
    ends = np.cumsum(lengths)
    pool = rng.integers(ord("a"), ord("z") + 1, size=int(ends[-1])).astype(np.uint8)
    pool[ends - 1] = ord(" ")
    starts = ends - lengths
    out = np.empty(size, np.uint8)
    pos = 0
    while pos < size:
        words = np.minimum(rng.zipf(1.15, size=1 << 18), vocabulary) - 1
        n = lengths[words]
        offsets = np.cumsum(n) - n
        chunk = pool[np.repeat(starts[words] - offsets, n) + np.arange(int(n.sum()))]
        take = min(chunk.size, size - pos)
        out[pos:pos + take] = chunk[:take]
        pos += take
    return out.tobytes()


def parse_size(text: str) -> int:
    """'64M' -> 67108864 (suffixes k, M, G: powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip()
    scale = units.get(text[-1:].lower(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use 64M, 300k, ...)") from None
    if value < 0:
        raise argparse.ArgumentTypeError("a size is not negative")
    return value * scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--generate", type=parse_size, metavar="SIZE",
                        help="first write SIZE bytes of text-like data to INPUT")
    parser.add_argument("--brick", type=int, default=8, help="1 MiB blocks per brick")
    parser.add_argument("--no-overlap", action="store_true",
                        help="only the sequential pipeline (and lz4.frame)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the best counts")
    args = parser.parse_args(argv)
    if args.brick < 1 or args.repeat < 1:
        parser.error("--brick and --repeat are at least 1")
    if args.generate is not None:
        with open(args.input, "wb") as f:
            f.write(text_like(args.generate))
    with open(args.input, "rb") as f:
        data = f.read()

    directory = os.path.dirname(os.path.abspath(args.output))
    runs: list[tuple[str, Callable[[], Timing]]] = [
        ("lz4.frame.compress, 1 thread", lambda: run_reference(args.input, directory))]
    if not args.no_overlap:
        runs.append((f"aaccl overlapped, bricks of {args.brick}",
                     lambda: run_pipeline(pipeline, args.input, args.output, args.brick)))
    runs.append(("aaccl sequential (--no-overlap)",
                 lambda: run_pipeline(sequential, args.input, args.output, args.brick)))
    best: dict[str, Timing] = {}
    ok = True
    for _ in range(args.repeat):  # interleaved, so that noise from elsewhere hits all alike
        for label, run in runs:
            timing = run()
            if label not in best or timing.wall < best[label].wall:
                best[label] = timing
            if label.startswith("aaccl"):
                ok &= round_trip_ok(data, args.output)
    ratio = os.path.getsize(args.output) / max(1, len(data))
    print(f"{len(data)} bytes, LZ4 frame {ratio:.3f} of that; timed from reading INPUT (in the "
          f"page cache) to the complete frame written to a file; best of {args.repeat}; cores = CPU time / wall")
    reference = best[runs[0][0]].wall
    print(f"  {'':34} {'MB/s':>8} {'cores':>6} {'vs lz4.frame':>13}")
    for label, _ in runs:
        t = best[label]
        print(f"  {label:34} {len(data) / 1e6 / t.wall:8.1f} {t.cpu / t.wall:6.2f} "
              f"{reference / t.wall:12.2f}x")
    print("round trip (lz4.frame.decompress of OUTPUT == INPUT):", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
