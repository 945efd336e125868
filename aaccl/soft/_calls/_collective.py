"""A rank's call of a collective, as its peers see it: its fingerprint, checked
against theirs (in their messages, and by the fabric: `Collective.join`), and the
notices that end their calls at once when ours fails (`_tell_peers`), or ours when
one of theirs does (`peer_failed`). How the fabric takes part in the collective
(a roll call and meetings in process, MPI's lane) is its port's: `port.collective`.
`ScheduleCall` (`_schedule`) runs what is left: the schedule."""

from __future__ import annotations

from typing import Any

from ..._constants import ErrorCode, Scenario
from ..._errors import Aborted
from .._engine import Wait
from .._datapath import Datapath
from ..fabric import Collective, Fingerprint, Key, Message
from ..fabric._message import describe
from ._state import (COLLECTIVES, MISMATCH, REDUCING, ROOTED, SIZE_MISMATCH, CallFailed, Comm,
                     SoftCall, check_compression, describe_call)


class CollectiveCall(SoftCall):
    """copy, combine and the collectives (copy and combine have no communicator:
    nothing of this concerns them)."""

    __slots__ = ("comm", "seq", "prefix", "fp", "way", "path", "meeting")

    # (declared here once: `prepare` sets them on a fast path and on the full one)
    comm: Comm | None
    prefix: Key | None
    seq: int
    fp: Fingerprint | None
    path: Datapath | None
    way: Collective | None  # how its fabric takes part (None: messages)
    meeting: Any  # in process: the meeting it joined, until it came or gave its place up
    quiet = False
    """Its failure came from a peer, which has told the others (set where so)."""

    def prepare(self) -> None:
        """Take the call's place among its communicator's collectives and check it
        against the peers' calls of this collective: their fingerprints in their
        messages, now and as they come, and by the fabric's means (in process: all
        at once). Arguments seen before skip decoding (`SoftDevice.remember`)."""
        args, dev = self.args, self.dev
        known = dev.decoded.get(args[:9])  # decoded before: a loop of the same collective
        if known is None:
            self.comm = self.prefix = self.fp = self.path = self.way = None
            self.seq = 0
            if args.scenario not in COLLECTIVES:  # copy, combine
                if args.stream_flags:
                    self.use_streams(1, True)
                check_compression(args)
                return
            comm = dev.comm(args.comm)
        else:
            comm, self.path, self.fp, self.way = known
        self.comm, inbox = comm, dev.inbox
        self.seq = seq = inbox.coll_seq.get(comm.key, 0)  # (`Inbox.admit`, inline)
        inbox.coll_seq[comm.key] = seq + 1
        self.prefix = prefix = ("coll", comm.key, seq)
        if self.way is None:  # (not remembered: the port says, for this call)
            self.way = dev.port.collective(self)
            if known is None:
                self._decode(comm, self.way)
        if inbox._failed or inbox._seen:  # peers' messages for calls not joined (rarely)
            failure = inbox.join(prefix, self)
        else:  # (`Inbox.join`'s common case, in line: nothing came before us to check)
            inbox.members[prefix], failure = self, None
        differs = None if self.way is None else self.way.join(self)
        if failure is not None or differs is not None:
            code, why, notified = failure or (*differs, False)  # type: ignore[misc]
            self.quiet = notified
            if not code:  # a peer's call was aborted, or it rejected its call
                self.failure_error = Aborted(why)
                code = MISMATCH  # (the call ends with `failure_error`)
            raise CallFailed(code, why)

    def _decode(self, comm: Comm, way: Collective | None) -> None:
        """The first call with these arguments: its datapath and fingerprint, and the
        checks that the calls with them after it skip (`SoftDevice.remember`). One
        that can never run takes its turn at once all the same; one that fails those
        checks fails once it has joined its peers (who check their calls against it)."""
        args = self.args
        try:
            if args.scenario in ROOTED and args.root_src_dst >= comm.size:
                raise CallFailed(ErrorCode.DMA_DECODE_ERROR)
            self.path = path = self.dev.datapath(args)
        except CallFailed as failed:
            if way is not None:  # (it counts all the same)
                way.reject(self, failed)
            raise
        scenario = args.scenario
        self.fp = fp = (int(scenario), None if scenario == Scenario.BARRIER else args.count,
                        path.dtype.str, path.wire.str, args.root_src_dst if scenario in ROOTED
                        else None, args.function if scenario in REDUCING else None, comm.size)
        try:
            if args.stream_flags:
                self.use_streams(comm.size, args.root_src_dst == comm.rank
                                 or args.scenario not in ROOTED)
            check_compression(args)
        except CallFailed as failed:  # (as `admit` keeps a raised one)
            self.failure, self.failure_detail = failed.code, failed.detail
            return
        if not args.stream_flags:  # the same arguments decode alike
            self.dev.remember(args, (comm, path, fp, way if way is not None and way.shared
                                     else None))

    def describe(self) -> str:
        fp = self.fp
        return describe_call(self.args) if fp is None else describe(fp)

    def where(self) -> str:
        comm = self.comm
        if comm is None:
            return ""
        return f" on the communicator of ranks {', '.join(map(str, comm.sessions))}"

    @property
    def session(self) -> int:
        """Its CCLO's rank (session), as the inbox names it (`fabric.Inbox.join`)."""
        return self.dev.session

    def peer_failed(self, code: int, why: str, notified: bool) -> None:
        """Inbox: a peer's call of our collective failed (`notified`) or does not
        match ours: so does ours, at once (as an event: we may be inside a send)."""
        self.quiet = self.quiet or notified
        if code:
            self.dev.engine.soon(self.fail_now, CallFailed(code, why))
        else:  # the peer's call was aborted: ours is too
            self.dev.engine.soon(self.fail_now, CallFailed(MISMATCH, why), Aborted(why))

    def abandon(self) -> None:
        if self.prefix is None:
            return
        if self.way is not None:  # the others must not wait for us
            self.way.abandon(self)
        self.dev.inbox.abandon_steps(self.prefix)  # peers' messages would fill rx buffers

    def abort(self) -> None:
        why = "it did not run: a call it waits for failed" if self.aborting is None \
            else str(self.aborting)
        self._tell_peers(0, why)
        if self.way is not None:
            self.way.abort(self, why)
        super().abort()

    def end(self, retcode: int, detail: str | None) -> None:
        if self.aborting is not None:
            self._tell_peers(0, str(self.aborting))
        elif retcode or self.failure:
            code, why = (retcode, detail) if retcode else (self.failure, self.failure_detail)
            self._tell_peers(code, why)
        super().end(retcode, detail)

    def _tell_peers(self, code: int, why: str | None) -> None:
        """Our call of a collective failed: tell every other member, so that theirs
        fail at once (or as soon as they make it) instead of timing out."""
        prefix, comm = self.prefix, self.comm
        if prefix is None or comm is None:
            return
        self.dev.inbox.leave(prefix)
        if self.quiet or comm.size == 1 or self.dev.aborted is not None:
            return
        self.quiet = True
        me, notice = self.dev.session, self.notice(code, why)
        for peer in comm.sessions:
            if peer != me:
                msg = Message(me, ("abort", comm.key, self.seq), self.seq, 0, None, eager=True)
                msg.notice = (code, notice)
                self.dev.port.post(peer, msg, 0)

    def notice(self, code: int, why: str | None) -> str:
        """Our call's failure, in words for its peers."""
        desc = self.describe()
        if code in (MISMATCH, SIZE_MISMATCH) and why:
            return why  # names both sides already
        if code:
            names = ", ".join(ErrorCode(code).names())
            return f"rank {self.dev.session}'s {desc} failed ({names})" + (f": {why}" if why else "")
        return f"rank {self.dev.session}'s {desc} was aborted: {why}"

    def waiting_for(self, wait: Wait) -> str:
        if self.way is not None:
            words = self.way.waiting_for(self, wait)
            if words is not None:
                return words
        return super().waiting_for(wait)

    def peers_waited(self, wait: Wait) -> list[int]:
        if self.way is not None and self.comm is not None:
            peers = self.way.peers_waited(self, wait)
            if peers is not None:
                return peers
        sources = getattr(wait, "sources", None)
        if sources is not None:
            return sources()
        missing = getattr(wait, "missing", None)
        if missing is not None and self.comm is not None:
            return [self.comm.sessions[r] for r in missing()]
        dst = getattr(wait, "dst", None)  # over MPI: a payload a peer is to take
        return [] if dst is None else [dst]
