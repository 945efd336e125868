"""Collective algorithms as pure, I/O-free schedules."""

from ._schedules import (
    SMALL_ALLREDUCE_COUNT,
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

__all__ = ["SMALL_ALLREDUCE_COUNT", "Copy", "Incoming", "Local", "Operand", "Reduce", "Send", "Step", "chunks", "schedule"]
