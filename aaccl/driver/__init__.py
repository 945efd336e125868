"""The CCLO host protocol: exchange memory, the 12-argument call, return codes."""

from ._driver import EAGER_ONLY, STACKS, Driver, check_buffers, eager_threshold

__all__ = ["EAGER_ONLY", "STACKS", "Driver", "check_buffers", "eager_threshold"]
