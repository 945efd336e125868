"""Fabrics carry messages between soft CCLOs; the inbox matches them on arrival."""

from ._inbox import Inbox, RxPool
from ._inprocess import InProcessFabric, InProcessPort
from ._matching import PostedRecv
from ._message import Collective, Fingerprint, Key, Message, MessageState, Port
from ._mpi import MPIFabric

__all__ = ["Collective", "Fingerprint", "InProcessFabric", "InProcessPort", "Inbox", "Key",
           "MPIFabric", "Message", "MessageState", "Port", "PostedRecv", "RxPool"]
