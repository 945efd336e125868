"""Devices: what a CCLO looks like to the driver (see `Device`), and the `Call` each
of its calls is, from the device to the task awaiting it."""

from ._base import Device, DeviceCall
from ._call import Call, CallArgs

__all__ = ["Call", "CallArgs", "Device", "DeviceCall"]
