"""`aaccl info`: which devices this machine can drive, and why the others are out."""

from __future__ import annotations

import importlib.metadata
import json
from typing import NamedTuple

from ..devices import _emulator, _pynq, _xrt
from ._launch import find_mpiexec


class Row(NamedTuple):
    device: str
    available: bool
    detail: str


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _mpi() -> Row:
    mpi4py = _version("mpi4py")
    if mpi4py is None:
        return Row("soft over MPI", False, "mpi4py is not installed: pip install 'aaccl[mpi]'")
    try:
        mpiexec = find_mpiexec()
    except SystemExit:
        return Row("soft over MPI", False, f"mpi4py {mpi4py}, but no mpiexec is installed")
    return Row("soft over MPI", True, f"mpi4py {mpi4py}, {mpiexec}: aaccl launch -n N app.py")


def report(emulator_port: int = _emulator.DEFAULT_PORT) -> list[Row]:
    """One row per device: usable here or not, and why."""
    return [
        Row("soft", True, "embedded software CCLO, ranks as tasks of one process"),
        _mpi(),
        Row("emulator", *_emulator.available(emulator_port)),
        Row("xrt", *_xrt.available()),
        Row("pynq", *_pynq.available()),
    ]


def render(rows: list[Row], as_json: bool = False) -> str:
    if as_json:
        return json.dumps([row._asdict() for row in rows], indent=2)
    width = max(len(row.device) for row in rows)
    return "\n".join(f"{row.device:<{width}}  {'yes' if row.available else 'no ':<3}  {row.detail}"
                     for row in rows)
