"""Devices: what a CCLO looks like to the driver (see `Device`)."""

from ._base import CallArgs, Device, DeviceCall

__all__ = ["CallArgs", "Device", "DeviceCall"]
