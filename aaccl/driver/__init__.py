"""The CCLO host protocol: exchange memory, the 12-argument call, return codes."""

from ._driver import Driver

__all__ = ["Driver"]
