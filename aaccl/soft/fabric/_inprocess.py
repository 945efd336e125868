"""The in-process fabric: soft CCLOs of one process hand messages over directly.

Rendezvous payloads are never copied in transit: the receiver reads them straight
from the sender's device memory, which stays put until the receiver releases it.
"""

from __future__ import annotations

from ._inbox import Inbox
from ._message import COMPLETED, Message, SendRequest


class InProcessFabric:
    """Connects the inboxes of one process's soft CCLOs, by session (global rank)."""

    def __init__(self, size: int) -> None:
        self.inboxes = [Inbox() for _ in range(size)]

    def port(self, session: int) -> InProcessPort:
        return InProcessPort(self, session)


class _Rendezvous:
    __slots__ = ("inbox", "msg")

    def __init__(self, inbox: Inbox, msg: Message) -> None:
        self.inbox, self.msg = inbox, msg

    def wait(self, deadline: float) -> bool:
        return self.inbox.wait_consumed(self.msg, deadline)


class InProcessPort:
    def __init__(self, fabric: InProcessFabric, session: int) -> None:
        self.fabric, self.session = fabric, session
        self.inbox = fabric.inboxes[session]

    def post(self, dst: int, msg: Message) -> SendRequest:
        inbox = self.fabric.inboxes[dst]
        return COMPLETED if inbox.deliver(msg) else _Rendezvous(inbox, msg)

    def close(self) -> None:
        pass
