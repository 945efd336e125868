"""Same program, same results: the soft CCLO with its portable options against ACCL's
firmware (`aaccl compare`, aaccl/cli/_compare.py).

Every collective over sizes 1..4096 and every root (`_compare.sweep`):
- in CI, on the soft CCLO against numpy, and on the soft CCLO made to take the calls
  a firmware device gets (the driver's substitutes for what the firmware gets
  wrong, aaccl/driver/_firmware.py), bit for bit against the plain soft CCLO;
- with AACCL_EMULATOR naming a cclo_emu binary, on ACCL's emulator against the soft
  CCLO, bit for bit (the emulator stand-in of tests/test_emulator_protocol.py runs
  no collectives, so this part needs the real one).
`aaccl compare` itself runs in CI against the stand-in.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aaccl
from aaccl import ReduceFunction
from aaccl.cli import _compare as compare
from aaccl._constants import Scenario
from aaccl.cli import main as cli
from aaccl.driver import _firmware as firmware
from aaccl.soft import SoftDevice

SUM, MAX = ReduceFunction.SUM, ReduceFunction.MAX
EMULATOR = os.environ.get("AACCL_EMULATOR", "")


# -- the sweep itself, against numpy ------------------------------------------------------------

def reference(op: str, count: int, root: int, func: ReduceFunction | None, size: int,
              rank: int, case: int) -> np.ndarray:
    """What `sweep`'s case `case` leaves in rank `rank`'s output buffer, by numpy."""
    n_in, n_out = compare.lengths(op, size, count)
    ins = [compare.inputs(r, case, n_in) for r in range(size)]
    out = np.full(max(n_out, 1), compare.SENTINEL, np.float32)
    mine = slice(rank * count, (rank + 1) * count)
    folded = None if func is None else (np.sum if func == SUM else np.max)(ins, axis=0)
    if op == "sendrecv":
        out[:count] = ins[(rank - 1) % size]
    elif op == "bcast":
        out[:count] = ins[root]
    elif op == "scatter":
        out[:count] = ins[root][mine]
    elif op == "gather" and rank == root or op == "allgather":
        out[:n_out] = np.concatenate(ins)
    elif op == "reduce" and rank == root or op == "allreduce":
        out[:count] = folded
    elif op == "reduce_scatter":
        out[:count] = folded[mine]
    elif op == "alltoall":
        out[:n_out] = np.concatenate([x[mine] for x in ins])
    return out


@pytest.mark.parametrize("size, stack", [(1, "tcp"), (2, "tcp"), (3, "tcp"), (2, "rdma"),
                                         (3, "rdma")])
def test_the_sweep_on_the_soft_cclo_matches_numpy(size: int, stack: str) -> None:
    rendezvous = stack == "rdma"

    async def main(accl: aaccl.ACCL) -> list[np.ndarray]:
        return await compare.sweep(accl, compare.SIZES, rendezvous)

    results = aaccl.run(main, size, stack=stack, **compare.PORTABLE, **compare.SWEEP_OPTIONS)
    cases = compare.cases(size, compare.SIZES, rendezvous)
    assert {c[1] for c in cases} >= {1, 4096} and len(results[0]) == len(cases)
    if size > 1:
        assert {c[2] for c in cases if c[0] == "bcast"} == set(range(size))  # every root
    for rank, got in enumerate(results):
        for i, (op, count, root, func) in enumerate(cases):
            want = reference(op, count, root, func, size, rank, i)
            assert got[i].tobytes() == want.tobytes(), (rank, op, count, root, func)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_firmware_path_gives_the_soft_cclos_results_bit_for_bit(
        size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main(accl: aaccl.ACCL) -> list[np.ndarray]:
        return await compare.sweep(accl)

    options = {"stack": "tcp", **compare.PORTABLE, **compare.SWEEP_OPTIONS}
    plain = aaccl.run(main, size, **options)
    made: list[Any] = []
    real = firmware.substitute

    def substitute(*args: Any) -> Any:
        steps = real(*args)
        made.extend([steps[0].scenario] if steps else [])
        return steps

    monkeypatch.setattr(SoftDevice, "runs_accl_firmware", True, raising=False)
    monkeypatch.setattr(firmware, "substitute", substitute)
    substituted = aaccl.run(main, size, **options)
    assert compare.differences(plain, substituted, ("soft", "firmware path")) == []
    # some allreduces went as reduce + bcast, some bcasts from the last rank in pieces
    assert {Scenario.REDUCE, Scenario.BCAST} <= set(made)


# -- the comparison -------------------------------------------------------------------------

def test_differences_say_where_and_what() -> None:
    a = [[np.arange(4, dtype=np.float32), "x", {"k": 1}]]
    assert compare.differences(a, [[np.arange(4, dtype=np.float32), "x", {"k": 1}]]) == []
    b = [[np.array([0, 1, 7, 9], np.float32), "y", {"k": 1}]]
    assert compare.differences(a, b) == [
        "rank 0 result[0]: 2 of 4 elements differ, the first at 2: soft 2.0, emulator 7.0",
        "rank 0 result[1]: soft gave 'x', emulator 'y'"]
    zero, minus_zero = np.zeros(1, np.float32), -np.zeros(1, np.float32)
    assert compare.differences([[zero]], [[minus_zero]])  # equal, but not the same bits
    assert "differ in shape" in compare.differences([[1, 2]], [[1]])[0]
    assert "float32[4], emulator float64[4]" in compare.differences(
        [[np.zeros(4, np.float32)]], [[np.zeros(4)]])[0]


# -- aaccl compare, against the emulator stand-in ----------------------------------------------

PROGRAM = '''
import numpy as np

async def copies(accl):
    src, dst = accl.allocate(300, np.float32), accl.allocate(300, np.float32)
    src[:] = np.arange(300)
    await accl.copy(src, dst, 300)
    return [np.array(dst), {"rank": accl.rank}]

async def tells(accl):
    return type(accl._driver.device).__name__
'''


def test_aaccl_compare_against_the_stand_in(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("zmq", reason="the emulator device needs pyzmq")
    from test_emulator_protocol import FakeEmulator

    program = tmp_path / "prog.py"
    program.write_text(PROGRAM)
    fake = FakeEmulator()
    try:
        argv = ["compare", "-n", "1", "--emulator-port", str(fake.port), "--timeout", "5"]
        assert cli([*argv, f"{program}:copies"]) == 0
        out = capsys.readouterr().out
        assert "the same results, bit for bit, on every rank" in out
        assert f"ACCL's emulator at port {fake.port}" in out
        assert cli([*argv, f"{program}:tells"]) == 1
        out = capsys.readouterr().out
        assert "rank 0 result: soft gave 'SoftDevice', emulator 'EmulatorDevice'" in out
        assert "1 difference(s)" in out
        assert cli([*argv]) == 1  # the sweep: the stand-in runs no collectives
        assert "emulator raised CCLOError" in capsys.readouterr().out
    finally:
        fake.close()
    assert fake.violations == []


def test_aaccl_compare_without_an_emulator_says_it_could_not_compare(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not "1 difference(s)": nothing ran, and the user learns why and what to start."""
    program = tmp_path / "prog.py"
    program.write_text(PROGRAM)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status = cli(["compare", "-n", "2", "--emulator-port", str(port), f"{program}:copies"])
    out, err = capsys.readouterr()
    assert status == compare.NOT_COMPARED == 3
    assert "difference" not in out + err
    assert "could not compare, ACCL's emulator is not running" in err
    assert f"cclo_emu -s 2 -r $r -p {port} -c tcp" in err and "docs/emulator.md" in err
    assert "for r in 0 1;" in err


@pytest.mark.parametrize("spec, message", [("nocolon", "module:function"),
                                           ("missing_file.py:main", "no Python file"),
                                           ("json:nothing_here", "has no function")])
def test_aaccl_compare_says_what_it_cannot_load(spec: str, message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["compare", spec]) == 2
    assert message in capsys.readouterr().err


# -- on ACCL's emulator (AACCL_EMULATOR) ------------------------------------------------------

@pytest.mark.skipif(not (EMULATOR and os.access(EMULATOR, os.X_OK)),
                    reason="set AACCL_EMULATOR to a cclo_emu binary built from Xilinx/ACCL "
                           "test/model/emulator to compare the soft CCLO with ACCL's firmware "
                           "(see docs/emulator.md); the stand-in in CI runs no collectives")
@pytest.mark.parametrize("size", [2, 3])
def test_every_collective_on_the_emulator_and_the_soft_cclo_bit_for_bit(
        size: int, tmp_path: Path) -> None:
    pytest.importorskip("zmq", reason="the emulator device needs pyzmq")
    from test_emulator import emulator

    async def main(accl: aaccl.ACCL) -> Any:
        return await compare.sweep(accl)

    with emulator(size, "tcp", tmp_path) as port:
        found = compare.compare(main, size, emulator_port=port, stack="tcp",
                                **compare.SWEEP_OPTIONS)
    assert found == [], "\n".join(found)
