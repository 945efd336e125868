"""Point-to-point calls: a send and its matching receive (by source, tag, and each
sender's sequence number), through the inbox's posted receives."""

from __future__ import annotations

import numpy as np

from ..._constants import ErrorCode
from .._datapath import OPERAND_FLAGS
from .._engine import Wait
from .._streams import StreamRead, segments
from ..fabric import Message, MessageState, PostedRecv
from ._state import (DEQUEUE_TIMEOUT, INBOUND_SEQ, MISMATCH, OUTBOUND_SEQ, SIZE_MISMATCH, Body,
                     CallFailed, SoftCall, check_compression, describe_call, tag_words)


class SendCall(SoftCall):
    __slots__ = ("comm", "seq", "sent")

    def prepare(self) -> None:
        args, dev = self.args, self.dev
        self.sent = False
        self.seq: int | None = None  # its place in the peer's message order, once taken
        self.comm = comm = dev.comm(args.comm)
        index = args.root_src_dst
        peer = comm.sessions[index] if 0 <= index < comm.size else comm.peer(index)  # (raises)
        if args.stream_flags:  # (no flags: no streams)
            self.use_streams(comm.size, False)
        if not self.res_stream:  # a put into the peer's stream is outside the message order
            self.seq = dev.next_send_seq(comm.key, peer)
            dev.count_message(args, OUTBOUND_SEQ)
        if args.compression_flags & OPERAND_FLAGS:
            check_compression(args)

    def run(self) -> Body:
        args, dev = self.args, self.dev
        path = dev.datapath(args)
        if self.op0_stream:  # the firmware reads the stream one segment at a time
            segment = dev.segment_elements(path.dtype)
            try:
                raw = yield from self.read_stream(segments(args.count * path.dtype.itemsize,
                                                           segment * path.dtype.itemsize))
            except CallFailed:
                self.abandon()
                raise
            data = raw.view(path.dtype)
        else:
            data = dev.array(args.addr_0, path.dtype, args.count)
        payload = data if path.wire == path.dtype else path.to_wire(data)
        eager = payload.nbytes <= dev.max_eager_size
        if self.res_stream:  # one-sided: into the peer's kernel stream, no receive
            msg = Message(dev.session, ("stream",), 0, args.tag, payload.view(np.uint8), eager)
            msg.fp = (path.wire.str, dev.segment_elements(path.dtype))
        else:
            assert self.seq is not None  # (taken by `prepare`: this is no stream put)
            msg = Message(dev.session, ("p2p", self.comm.key), self.seq, args.tag,
                          payload.view(np.uint8), eager=eager)
            msg.fp = (args.count, path.wire.str, path.dtype.str)
        self.sent = True
        handover = dev.port.post(self.comm.sessions[args.root_src_dst], msg, DEQUEUE_TIMEOUT)
        if handover is not None and (yield handover) is MessageState.WITHDRAWN:
            raise self.withdrawn(handover)

    def peers_waited(self, wait: Wait) -> list[int]:
        if isinstance(wait, StreamRead):
            return []
        return [self.comm.sessions[self.args.root_src_dst]]


    def waiting_for(self, wait: Wait) -> str:
        if self.res_stream:
            return f"rank {self.peers_waited(wait)[0]} to take its data into its kernel stream"
        return (f"rank {self.peers_waited(wait)[0]} to receive its message (no matching "
                f"recv(src={self.comm.rank}, {tag_words(self.args.tag)}) ran there)")

    def abandon(self) -> None:
        if not self.sent and self.seq is not None:  # fill our gap in the peer's sequence
            self.sent = True
            self.dev.port.post(self.comm.sessions[self.args.root_src_dst],
                               Message(self.dev.session, ("p2p", self.comm.key), self.seq,
                                       self.args.tag, None, eager=True, tombstone=True), 0)


class RecvCall(SoftCall):
    __slots__ = ("key", "src", "posted")

    def prepare(self) -> None:
        args, dev = self.args, self.dev
        self.posted: PostedRecv | None = None
        comm = dev.comm(args.comm)
        index = args.root_src_dst
        self.src = comm.sessions[index] if 0 <= index < comm.size else comm.peer(index)  # (raises)
        self.key = ("p2p", comm.key)
        if args.stream_flags:  # (no flags: no streams)
            self.use_streams(comm.size, False)
        if args.compression_flags & OPERAND_FLAGS:
            check_compression(args)
        self.posted = dev.inbox.post(self.key, self.src, args.tag)

    def run(self) -> Body:
        dev, args, posted = self.dev, self.args, self.posted
        assert posted is not None
        path = dev.datapath(args)
        dst = None if self.res_stream else dev.array(args.addr_2, path.dtype, args.count)
        try:
            if not posted.done:
                yield posted
        except CallFailed:
            self.abandon()
            raise
        msg = dev.inbox.take(posted)
        self.posted = None
        dev.count_message(args, INBOUND_SEQ)
        try:
            if msg.fp is not None and msg.fp[:2] != (args.count, path.wire.str):
                count, _, dtype = msg.fp
                code = SIZE_MISMATCH if count != args.count else MISMATCH
                sent = (f"send(count={count}, {np.dtype(dtype).name}, "
                        f"dst={dev.comm(args.comm).rank}, {tag_words(msg.tag)})")
                raise CallFailed(code, f"rank {msg.src} sent {sent}; rank {dev.session} "
                                       f"called {describe_call(args, path.dtype)}")
            data = dev.inbox.data(msg)
            if data.nbytes != args.count * path.wire.itemsize:
                raise CallFailed(ErrorCode.DMA_SIZE_ERROR)
            if dst is not None:
                dst[...] = data.view(path.wire)  # (copyto's casting="unsafe", C calls only)
            else:  # into the kernel stream, one packet per segment, as the firmware moves it
                values = data.view(path.wire).astype(path.dtype, copy=False)
                step = dev.segment_elements(path.dtype)
                for start in range(0, args.count, step):
                    dev.streams.emit(values[start:start + step], args.tag)
        finally:
            dev.inbox.release(msg)

    def peers_waited(self, wait: Wait) -> list[int]:
        return [self.src]


    def waiting_for(self, wait: Wait) -> str:
        return f"a message from rank {self.src} ({tag_words(self.args.tag)})"

    def abandon(self) -> None:
        if self.posted is not None:
            self.dev.inbox.cancel(self.key, self.src, self.posted)
            self.posted = None
