"""The in-process fabric: soft CCLOs of one process, sharing one progress engine.

Delivery is a call into the receiver's inbox in engine context. Rendezvous
payloads are never copied in transit: the receiver reads them straight from the
sender's device memory, which stays put until the receiver releases it.
"""

from __future__ import annotations

from .._engine import Engine, Wait
from ._inbox import Inbox
from ._message import Message, MessageState


class InProcessFabric:
    """Connects the inboxes of one process's soft CCLOs, by session (global rank)."""

    def __init__(self, size: int) -> None:
        self.engine = Engine(f"inprocess-{size}")
        self.inboxes = [Inbox() for _ in range(size)]

    def port(self, session: int) -> InProcessPort:
        return InProcessPort(self, session)


class _Handover(Wait):
    """A send whose payload the receiver reads from our memory: done once released."""

    __slots__ = ("inbox", "msg")

    def __init__(self, inbox: Inbox, msg: Message, timeout_code: int) -> None:
        super().__init__(timeout_code)
        self.inbox, self.msg = inbox, msg

    def expire(self) -> bool:
        """Withdraw the message if no receive has started on it (then the send
        fails); a receive reading it now finishes without a deadline."""
        return self.inbox.withdraw(self.msg) or self.msg.state == MessageState.WITHDRAWN


class InProcessPort:
    def __init__(self, fabric: InProcessFabric, session: int) -> None:
        self.fabric, self.session = fabric, session
        self.engine = fabric.engine
        self.inbox = fabric.inboxes[session]

    def post(self, dst: int, msg: Message, timeout_code: int) -> Wait | None:
        inbox = self.fabric.inboxes[dst]
        if inbox.deliver(msg):
            return None
        handover = _Handover(inbox, msg, timeout_code)
        msg.consumed = handover
        return handover

    def close(self) -> None:
        pass
