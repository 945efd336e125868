"""What a test marked `@pytest.mark.aaccl(...)` asks for, checked before any world
opens: pure, so a bad marker is a clear error and nothing reaches a device."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..api import open_world
from ..api._world import check_options

BACKENDS = ("asyncio", "trio")
_DEFAULTS = {name: p.default for name, p in inspect.signature(open_world).parameters.items()}
WORLD_OPTIONS = tuple(name for name in _DEFAULTS if name != "world_size")
MISSING: Any = object()  # world_size was not parametrized


class MarkerError(ValueError):
    """The marker, or the test it marks, cannot run as asked."""


@dataclass(frozen=True)
class Plan:
    """How to run one marked test."""

    world_size: int
    options: dict[str, Any] = field(default_factory=dict)  # open_world's keyword options
    backend: str = "asyncio"  # the loop, when the plugin runs the test itself
    backend_given: bool = False  # the marker insists on it
    per_rank: bool = True  # the body runs once per rank (it takes `accl`)
    mpi: bool = False  # one rank per process of an MPI job
    skip: str | None = None  # why the test cannot run here


def merged(markers: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]
           ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One marker's (args, kwargs) from several, the farthest first (a module's, a
    class's, the test's, its parameter's): the closer one wins where two say the same."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    for these, those in markers:
        if these and "world_size" in those:
            raise MarkerError("aaccl marker: world_size given twice")
        if these or "world_size" in those:
            args = tuple(these)
            kwargs.pop("world_size", None)
        kwargs.update(those)
    return args, kwargs


def world_size_of(args: Sequence[Any], kwargs: Mapping[str, Any], parametrized: Any,
                  job_size: int | None) -> int:
    """The world's size: the marker's (`aaccl(4)` or `aaccl(world_size=4)`), a
    parametrized `world_size`, or under mpiexec the job's."""
    if len(args) > 1:
        raise MarkerError(f"aaccl marker: one positional argument (world_size), got {len(args)}")
    marked = args[0] if args else kwargs.get("world_size", MISSING)
    if marked is not MISSING and parametrized is not MISSING and marked != parametrized:
        raise MarkerError(f"aaccl marker says world_size={marked!r}, but the test is "
                          f"parametrized with world_size={parametrized!r}")
    size = parametrized if parametrized is not MISSING else marked
    if size is MISSING or size is None:
        if job_size is not None:
            return job_size
        raise MarkerError("aaccl marker: give world_size (@pytest.mark.aaccl(world_size=4), or "
                          "parametrize world_size): outside mpiexec the ranks are tasks of "
                          "this process")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise MarkerError(f"aaccl marker: world_size must be a positive integer, got {size!r}")
    return size


def plan(args: Sequence[Any], kwargs: Mapping[str, Any], *, argnames: Sequence[str],
         is_async: bool, parametrized: Any = MISSING, job_size: int | None = None,
         default_device: str = "soft") -> Plan:
    """Check the marker of a test taking `argnames` and say how to run it.
    `job_size`: the number of processes of the MPI job this one belongs to, if any."""
    if not is_async:
        raise MarkerError("aaccl marker: the test must be an `async def` function")
    if "accl" not in argnames and "accl_world" not in argnames:
        raise MarkerError("aaccl marker: the test takes neither `accl` (its body runs once "
                          "per rank) nor `accl_world` (once, with every rank)")
    unknown = sorted(set(kwargs) - {"world_size", "backend", *WORLD_OPTIONS})
    if unknown:
        raise MarkerError(f"aaccl marker: unknown option {', '.join(unknown)}; options: "
                          f"world_size, backend, {', '.join(WORLD_OPTIONS)}")
    options = {k: v for k, v in kwargs.items() if k not in ("world_size", "backend")}
    options.setdefault("device", default_device)
    backend = kwargs.get("backend", "asyncio")
    if backend not in BACKENDS:
        raise MarkerError(f"aaccl marker: backend must be one of {', '.join(BACKENDS)}, "
                          f"got {backend!r}")
    mpi = job_size is not None and options.get("fabric", "auto") != "inprocess"
    size = world_size_of(args, kwargs, parametrized, job_size if mpi else None)
    world = {**_DEFAULTS, **options}
    try:  # open_world's own checks, now: a bad option fails the test's setup, not its body
        check_options(size, world["device"], world["fabric"], world["nbufs"], world["bufsize"],
                      world["timeout"], world["in_order"])
    except ValueError as error:
        raise MarkerError(f"aaccl marker: {error}") from None
    skip = None
    if mpi and size != job_size:
        skip = (f"world_size={size}: this MPI job has {job_size} processes (one per rank); "
                f"run it with mpiexec -n {size}")
    return Plan(size, options, backend, "backend" in kwargs, "accl" in argnames, mpi, skip)
