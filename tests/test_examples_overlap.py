"""The overlap examples: examples/lz4_frame.py (an LZ4 frame written through device
kernels, double buffered) and examples/overlap_allreduce.py.

The frame format is checked against the `lz4` package itself: its frames' header
checksums, and `lz4.frame.decompress` of every frame built here. The pipelines run
in process on small inputs; each script runs once end to end as a subprocess.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import example_module

import aaccl

lz4_frame_module = pytest.importorskip("lz4.frame")  # the `examples` extra

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MIB = 1 << 20


lz4f = example_module("lz4_frame")
decompress = lz4_frame_module.decompress


def incompressible(size: int, seed: int = 1) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def mixed(size: int) -> bytes:
    """Text-like data with an incompressible stretch: both kinds of block."""
    data = bytearray(lz4f.text_like(size))
    third = size // 3
    data[third:2 * third] = incompressible(third)
    return bytes(data)


def blocks(frame: bytes) -> list[tuple[int, bool]]:
    """(length, stored) of each block of a frame with a content size."""
    pos, out = 15, []
    while (word := int.from_bytes(frame[pos:pos + 4], "little")) != 0:
        out.append((word & ~lz4f.STORED, bool(word & lz4f.STORED)))
        pos += 4 + (word & ~lz4f.STORED)
    assert pos + 4 == len(frame), "bytes after the end mark"
    return out


# -- xxh32 and the header -------------------------------------------------------------

@pytest.mark.parametrize("data, digest", [
    (b"", 0x02CC5D05), (b"a", 0x550D7456), (b"abc", 0x32D153FF),
    (b"Nobody inspects the spammish repetition", 0xE2293B2F),  # > 16 bytes: the stripes
])
def test_xxh32_matches_the_reference_vectors(data: bytes, digest: int) -> None:
    assert lz4f.xxh32(data) == digest


@pytest.mark.parametrize("size", [0, 1, 1000, 70_000, 300_000])
@pytest.mark.parametrize("store_size", [False, True])
def test_header_checksum_agrees_with_lz4s_own_frames(size: int, store_size: bool) -> None:
    """lz4 picks its own descriptor (smaller block sizes for small inputs): the
    checksum of each must be what xxh32 gives for its descriptor bytes."""
    frame = lz4_frame_module.compress(b"x" * size, store_size=store_size, block_linked=False)
    has_size = bool(frame[4] & 0b1000)
    descriptor, checksum = frame[4:6 + 8 * has_size], frame[6 + 8 * has_size]
    assert (lz4f.xxh32(descriptor) >> 8) & 0xFF == checksum


@pytest.mark.parametrize("size", [MIB, 5 * MIB + 17])
def test_frame_header_is_byte_identical_to_lz4s(size: int) -> None:
    """From 1 MiB up lz4 keeps 1 MiB blocks: the same frame parameters, the same bytes."""
    reference = lz4_frame_module.compress(b"y" * size, block_size=lz4_frame_module.BLOCKSIZE_MAX1MB,
                                          block_linked=False, store_size=True)
    assert lz4f.frame_header(size) == reference[:15]


def test_frame_header_fields() -> None:
    header = lz4f.frame_header()
    assert header[:4] == b"\x04\x22\x4d\x18"  # magic 0x184D2204, little-endian
    assert header[4] == 0b0110_0000  # version 01, independent blocks, no checksums or size
    assert header[5] == 0x60  # block maximum size code 6: 1 MiB
    sized = lz4f.frame_header(5)
    assert len(header) == 7 and len(sized) == 15
    assert sized[4] & 0b1000 and sized[6:14] == (5).to_bytes(8, "little")  # content size


def test_block_header_and_end_mark() -> None:
    assert lz4f.block_header(5, stored=False) == b"\x05\x00\x00\x00"
    assert lz4f.block_header(lz4f.BLOCK, stored=True) == b"\x00\x00\x10\x80"
    assert lz4f.block_length(lz4f.block_header(1234, stored=True)) == 1234
    assert lz4f.END_MARK == b"\x00" * 4
    for bad in (-1, lz4f.BLOCK + 1):
        with pytest.raises(ValueError):
            lz4f.block_header(bad, stored=False)


# -- whole frames -----------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 1000, MIB, MIB + 1, 2 * MIB + MIB // 2])
def test_frames_decompress_with_lz4(size: int) -> None:
    data = lz4f.text_like(size)
    frame = lz4f.compress_frame(data)
    assert decompress(frame) == data
    assert len(blocks(frame)) == -(-size // MIB)


def test_incompressible_blocks_are_stored() -> None:
    data = incompressible(MIB + 4321)
    frame = lz4f.compress_frame(data)
    assert blocks(frame) == [(MIB, True), (4321, True)]
    assert decompress(frame) == data


def test_mixed_data_has_both_kinds_of_block() -> None:
    data = mixed(3 * MIB)
    frame = lz4f.compress_frame(data)
    assert {stored for _, stored in blocks(frame)} == {True, False}
    assert decompress(frame) == data


def test_generated_data_is_text_like_and_compressible() -> None:
    data = lz4f.text_like(MIB, seed=3)
    assert data == lz4f.text_like(MIB, seed=3) and len(data) == MIB
    assert set(data) <= set(b" abcdefghijklmnopqrstuvwxyz")
    assert 0.3 < len(lz4_frame_module.compress(data)) / MIB < 0.7


def test_parse_size() -> None:
    assert [lz4f.parse_size(s) for s in ("0", "300k", "64M", "1g")] == [0, 300 << 10, 64 << 20,
                                                                         1 << 30]
    with pytest.raises(argparse.ArgumentTypeError):
        lz4f.parse_size("lots")


# -- the pipelines on the soft CCLO -------------------------------------------------------------

def run(runner, data: bytes, brick: int) -> bytes:
    out = io.BytesIO()

    async def main(accl: aaccl.ACCL) -> None:
        await runner(accl, io.BytesIO(data), len(data), out, brick)

    aaccl.run(main, world_size=1)
    return out.getvalue()


@pytest.mark.parametrize("size, brick", [
    (0, 8), (1000, 8), (MIB, 8),  # empty, under a block, exactly one
    (7 * MIB + 12345, 3),  # three bricks, the last one partial
    (3 * MIB + 5, 1),  # bricks of one block
    (9 * MIB, 8),  # a full brick and one block more
])
def test_overlapped_pipeline_writes_the_host_frame(size: int, brick: int) -> None:
    data = mixed(size)
    frame = run(lz4f.pipeline, data, brick)
    assert frame == lz4f.compress_frame(data)  # LZ4 is deterministic: the same bytes
    assert decompress(frame) == data


@pytest.mark.parametrize("size", [0, 2 * MIB + 3])
def test_sequential_pipeline_writes_the_same_frame(size: int) -> None:
    data = mixed(size)
    assert run(lz4f.sequential, data, 8) == lz4f.compress_frame(data)


def test_a_brick_is_one_chain_of_transfer_kernels_transfer() -> None:
    """submit_brick returns the last call of the chain; awaiting it alone is enough
    to have every block's slot, header and compressed bytes, in host memory."""
    data = lz4f.text_like(3 * MIB)

    async def main(accl: aaccl.ACCL) -> bytes:
        slots = lz4f.Slots(accl, 4)
        slots.src[:len(data)] = np.frombuffer(data, np.uint8)
        done, packed = lz4f.submit_brick(accl, accl.kernel(lz4f.compress_block), slots,
                                         len(data))
        assert len(packed) == 3  # a kernel per block
        await done
        out = io.BytesIO()
        slots.write_out(3, out)
        return out.getvalue()

    body = aaccl.run(main, world_size=1)[0]
    assert lz4f.frame_header(len(data)) + body + lz4f.END_MARK == lz4f.compress_frame(data)


def test_a_bricks_kernels_run_at_once() -> None:
    """No kernel of a brick waits for another: each is passed only its block's memory.
    (When all of them were passed the whole lengths buffer, results-as-if-in-order
    ran them one after the other: the pipeline used 1.2 cores of 2.)"""
    data = lz4f.text_like(4 * MIB)
    meet = threading.Barrier(4, timeout=20)  # broken unless all four run together

    def compress_together(src: np.ndarray, dst: np.ndarray) -> None:
        meet.wait()
        lz4f.compress_block(src, dst)

    async def main(accl: aaccl.ACCL) -> None:
        slots = lz4f.Slots(accl, 4)
        slots.src[:] = np.frombuffer(data, np.uint8)
        await lz4f.submit_brick(accl, accl.kernel(compress_together), slots, len(data))[0]

    aaccl.run(main, world_size=1)
    assert not meet.broken


# -- the scripts, end to end -----------------------------------------------------------------------

def script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], check=False,
                          capture_output=True, text=True, timeout=120)


def test_lz4_frame_script_both_modes(tmp_path: Path) -> None:
    source, target = tmp_path / "in.txt", tmp_path / "out.lz4"
    done = script("lz4_frame.py", str(source), str(target), "--generate", "3M", "--brick", "2",
                  "--repeat", "1")
    assert done.returncode == 0, done.stderr
    for label in ("lz4.frame.compress", "aaccl overlapped", "aaccl sequential", "round trip"):
        assert label in done.stdout
    assert "ok" in done.stdout.splitlines()[-1]
    assert decompress(target.read_bytes()) == source.read_bytes()

    baseline = script("lz4_frame.py", str(source), str(target), "--no-overlap", "--repeat", "1")
    assert baseline.returncode == 0, baseline.stderr
    assert "aaccl sequential" in baseline.stdout and "overlapped" not in baseline.stdout
    assert decompress(target.read_bytes()) == source.read_bytes()


def test_overlap_allreduce_script_prints_the_efficiency() -> None:
    done = script("overlap_allreduce.py", "--ranks", "2", "--features", "64", "--batch", "64",
                  "--steps", "3", "--rounds", "1")
    assert done.returncode == 0, done.stderr
    assert "overlap efficiency" in done.stdout and "allreduce hidden" in done.stdout
