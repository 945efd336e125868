"""The devices behind pyaccl-style instances other than the soft CCLO (see _worlds):
ACCL's emulator and Alveo cards."""

from __future__ import annotations

from ..devices import Device


def emulator_device(host: str, port: int, rank: int, protocol: str) -> Device:
    """Rank `rank` of ACCL's emulator whose ranks' command sockets start at `port`."""
    from ..devices._emulator import EmulatorDevice

    return EmulatorDevice(rank, port=port, host=host, protocol=protocol.lower())


def card_device(xclbin: str, board_idx: int, cclo_idx: int) -> Device:
    from ..devices._pynq import PynqDevice

    return PynqDevice(xclbin, device_index=board_idx, cclo_index=cclo_idx)
