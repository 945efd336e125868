"""Fabrics carry messages between soft CCLOs; the inbox matches them on arrival."""

from ._inbox import Inbox, PostedRecv, RxPool
from ._inprocess import InProcessFabric, InProcessPort
from ._mpi import MPIFabric
from ._message import COMPLETED, Message, PeerTimeout, Port, SendRequest

__all__ = ["COMPLETED", "InProcessFabric", "MPIFabric", "InProcessPort", "Inbox", "Message", "PeerTimeout", "Port",
           "PostedRecv", "RxPool", "SendRequest"]
