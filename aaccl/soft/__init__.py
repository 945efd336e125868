"""The embedded software CCLO: a model of ACCL's CCLO that runs anywhere."""

from ._device import SoftDevice
from ._engine import Engine
from .fabric import InProcessFabric, MPIFabric

__all__ = ["Engine", "InProcessFabric", "MPIFabric", "SoftDevice"]
