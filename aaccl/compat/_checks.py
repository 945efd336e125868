"""The constructor's and `set_timeout`'s arguments, checked before anything is made.

Pure: a bad argument raises TypeError or ValueError here, so a failed `accl(...)`
takes no place in a world and opens no device.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _exchmem as xm
from ..driver import check_buffers
from ._tables import ACCLArithConfig, arith_records

MAX_TICKS = 0xFFFFFFFF
"""The CCLO's timeout register is 32-bit."""


@dataclass(frozen=True)
class Settings:
    """A constructor's arguments, checked. `mode` is "soft" (aaccl's soft CCLO),
    "emulator" (ACCL's, at `emulator`: host and this rank's port) or "card"."""

    size: int
    rank: int
    mode: str
    protocol: str
    nbufs: int
    bufsize: int
    records: list[xm.RankRecord]
    arith: dict[tuple[np.dtype, np.dtype], xm.ArithConfig]
    emulator: tuple[str, int] | None = None
    xclbin: str | None = None
    board_idx: int = 0
    cclo_idx: int = 0

    def call(self) -> str:
        """The constructor call, as error messages quote it."""
        where = {"soft": ", sim_mode=True", "emulator": ", sim_mode=True, sim_sock=...",
                 "card": ", xclbin=..."}[self.mode]
        return f"accl({self.size}, {self.rank}{where})"


def integer(value: Any, name: str, low: int | None = 0) -> int:
    """A whole number (numpy integers too; not a bool) of at least `low`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")
    return int(value)


def settings(nranks: Any, local_rank: Any, ranks: Any, protocol: Any, nbufs: Any,
             bufsize: Any, arith_config: Any, sim_mode: Any, xclbin: Any, sim_sock: Any,
             board_idx: Any, cclo_idx: Any) -> Settings:
    """Every argument of `accl(...)` checked, in pyaccl's meaning."""
    if not isinstance(sim_mode, bool):
        raise TypeError(f"sim_mode must be True or False, not {sim_mode!r}")
    if xclbin is not None and not isinstance(xclbin, (str, os.PathLike)):
        raise TypeError(f"xclbin must be a path to a bitstream, not {xclbin!r}")
    if not sim_mode and xclbin is None:
        raise ValueError("FPGA bitstream must be provided")
    if sim_sock is not None and not isinstance(sim_sock, str):
        raise TypeError(f"sim_sock must be a ZMQ address such as 'tcp://localhost:5500', "
                        f"not {sim_sock!r}")
    mode = "card" if not sim_mode else "soft" if sim_sock is None else "emulator"
    nranks = integer(nranks, "nranks", 1)
    size = nranks if ranks is None else _ranks_given(ranks)
    rank = integer(local_rank, "local_rank")
    if rank >= size:
        raise ValueError(f"local_rank {rank} is not a rank of a world of {size}")
    if protocol is not None and protocol not in ("TCP", "UDP", "AXIS"):
        raise ValueError("Unrecognized Protocol" if protocol != "RDMA"
                         else "RDMA not supported yet")
    arith = _arith(arith_config)
    check_buffers(nbufs, bufsize, size, arith.values())
    return Settings(
        size=size, rank=rank, mode=mode, protocol=protocol or ("TCP" if sim_mode else "AXIS"),
        nbufs=int(nbufs), bufsize=int(bufsize),
        records=_records(size, ranks, int(bufsize), soft=mode == "soft"), arith=arith,
        emulator=_zmq_address(sim_sock, rank) if sim_mode and sim_sock is not None else None,
        xclbin=None if xclbin is None else os.fspath(xclbin),
        board_idx=0 if board_idx is None else integer(board_idx, "board_idx"),
        cclo_idx=integer(cclo_idx, "cclo_idx"))


def timeout_ticks(value: Any) -> int:
    """`set_timeout`'s argument: timer ticks the CCLO's register holds."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    ticks = integer(value, "timeout", None)
    if not 0 < ticks <= MAX_TICKS:
        raise ValueError(f"timeout must be 1 to {MAX_TICKS} timer ticks (the CCLO's 32-bit "
                         f"register), got {ticks}")
    return ticks


def _ranks_given(ranks: Any) -> int:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
        raise TypeError("ranks must be a list of one dict per rank ({'ip': ..., 'port': ...}), "
                        f"not {ranks!r}")
    return len(ranks)


def _records(size: int, ranks: Sequence[Any] | None, bufsize: int,
             soft: bool) -> list[xm.RankRecord]:
    """pyaccl's rank dicts as communicator records. The soft CCLO addresses its peers
    by session, so there each rank's session is its index."""
    if ranks is None:
        ranks = [{"ip": "127.0.0.1", "port": 9000 + i, "session_id": i,
                  "max_segment_size": bufsize} for i in range(size)]
    records = []
    for i, r in enumerate(ranks):
        try:
            if not isinstance(r, Mapping):
                raise TypeError("not a dict")
            session = i if soft else integer(r.get("session_id", xm.NO_SESSION), "session_id")
            records.append(xm.RankRecord(
                ip=_ip(r["ip"]), port=integer(r["port"], "port"), session=session,
                max_segment_size=integer(r.get("max_segment_size", bufsize), "max_segment_size",
                                         1)))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"ranks[{i}] = {r!r} is no rank as pyaccl describes one "
                             f"({{'ip': '10.0.0.1', 'port': 5001, ...}}): {error}") from None
    return records


def _ip(text: Any) -> int:
    if not isinstance(text, str) or not re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", text) \
            or any(int(part) > 255 for part in text.split(".")):
        raise ValueError(f"ip {text!r} is not an IPv4 address")
    return xm.ip_encode(text)


def _arith(configs: Any) -> dict[tuple[np.dtype, np.dtype], xm.ArithConfig]:
    if not isinstance(configs, Mapping) or not configs:
        raise TypeError(f"arith_config must be a dict of ACCLArithConfig by (uncompressed, "
                        f"compressed) dtype name, not {configs!r}")
    for key, cfg in configs.items():
        if not (isinstance(key, tuple) and len(key) == 2) or not isinstance(cfg, ACCLArithConfig):
            raise TypeError(f"arith_config[{key!r}] must be an ACCLArithConfig under a "
                            "(uncompressed, compressed) pair of dtype names")
    try:
        return arith_records(dict(configs))
    except TypeError as error:
        raise TypeError(f"arith_config names a dtype numpy does not know: {error}") from None


def _zmq_address(sim_sock: str, rank: int) -> tuple[str, int]:
    """(host, start port) of ACCL's emulator, from pyaccl's `sim_sock` (rank `rank`'s
    own command socket, such as "tcp://localhost:5500")."""
    match = re.fullmatch(r"tcp://([^:/]+):(\d+)", sim_sock)
    if match is None or int(match[2]) - rank < 1:
        raise ValueError(f"sim_sock {sim_sock!r} is not a ZMQ TCP address such as "
                         "'tcp://localhost:5500'")
    return "127.0.0.1" if match[1] == "localhost" else match[1], int(match[2]) - rank
