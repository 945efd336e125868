"""The CCLO host protocol: exchange memory, the 12-argument call, return codes."""

from ._driver import Driver, check_buffers

__all__ = ["Driver", "check_buffers"]
