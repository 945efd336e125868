"""Collective algorithms as pure, I/O-free schedules."""

from ._schedules import (
    Copy,
    Incoming,
    Local,
    Operand,
    Reduce,
    Send,
    Step,
    chunks,
    schedule,
)

__all__ = ["Copy", "Incoming", "Local", "Operand", "Reduce", "Send", "Step", "chunks", "schedule"]
