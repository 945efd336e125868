"""The embedded software CCLO: a model of ACCL's CCLO that runs anywhere."""

from ._device import SoftDevice
from .fabric import InProcessFabric, MPIFabric

__all__ = ["InProcessFabric", "MPIFabric", "SoftDevice"]
