"""Fabrics carry messages between soft CCLOs; the inbox matches them on arrival."""

from ._inbox import Inbox, PostedRecv, RxPool
from ._inprocess import InProcessFabric, InProcessPort
from ._mpi import MPIFabric
from ._message import COMPLETED, Key, Message, PeerTimeout, Port, SendRequest

__all__ = ["COMPLETED", "InProcessFabric", "InProcessPort", "Inbox", "Key", "MPIFabric", "Message",
           "PeerTimeout", "Port", "PostedRecv", "RxPool", "SendRequest"]
