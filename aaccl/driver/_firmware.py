"""Calls ACCL's firmware gets wrong as they are, and equivalent calls it gets right.

Pure rules over a call's shape, read from Xilinx/ACCL at 723d8ec: the firmware
(kernels/cclo/fw/sw_apps/ccl_offload_control/src/ccl_offload_control.c) and its DMA
mover (kernels/cclo/hls/dma_mover/dma_mover.cpp). The driver applies them to calls
bound for a firmware CCLO (ACCL's emulator, a card); the soft CCLO needs none.

Where they bite, always on the eager path (the firmware takes it when the message
is at most its eager threshold, or compressed, or streamed) and with two ranks or
more:

- **A receive of zero bytes never ends.** The DMA mover turns a MOVE_ON_RECV of zero
  elements into no DMA command, yet its retire stage still waits for that command's
  status: the call hangs. Every collective of `count == 0` that receives (scatter,
  gather, reduce, allgather, reduce_scatter) makes one.
- **The eager ring allreduce** cuts the data into segments of `S = bufsize //
  itemsize` elements rounded down to a multiple of the ranks `P`, and each segment
  of `E` elements into `P` chunks of `ceil(E / P)`, the last holding the rest,
  `E - ceil(E / P) * (P - 1)` (unsigned). Every rank moves every chunk, so a rest of
  zero is such a receive; a negative one wraps to about 4 GiB (and the chunk
  before it reaches past the segment). Only the last segment can be short, so the
  counts that hang are those whose last segment `E` leaves no rest: `E < P` always,
  and some more below `P * (P - 1)` (on 2 ranks just `E == 1`; on 3, `E` in 1, 2, 4;
  on 4, in 1, 2, 3, 5, 6, 9). With `S == 0` (fewer than `P` elements fit an rx
  buffer) every segment is empty and the loop never ends.
- **The eager bcast from the last rank** sends each segment to ranks 0..P-1 in turn,
  with a move of zero elements for the root itself; the next segment's source
  address is MOVE_INCREMENT, the address of the move before plus its length. For
  root `P - 1` that move before is its own zero-length one, so every segment after
  the first re-sends the first: wrong data, no error, whenever the message spans
  more than one rx buffer (`count > bufsize // itemsize`).

- **The eager scatter, gather and allgather** move each rank's whole chunk as one
  message (the scatter's source says "TODO: implement segmentation"; the ring
  gather and allgather relay whole chunks), where send and bcast cut theirs into
  rx buffers. On the emulator a chunk of 2 or 3 rx buffers arrives (slowly), one
  of more stalls the sender's transmit path (its `eth_tx_cmd` and
  `dma_read_data_1` streams stay full) until every rank times out: a scatter,
  gather or allgather of 4,096 float32 per rank with 4 KiB rx buffers never ends. A message larger than an rx buffer is
  nothing the receiving side's rx buffers are made for, so any such call whose
  chunk spans more than one rx buffer runs as what it means: the root copies its
  own chunk and sends each other rank its own (scatter), or receives each
  rank's (gather); in an allgather each rank copies its own and, in step k,
  sends it to the k-th next rank and receives the k-th previous one's; messages
  cut into rx buffers by the firmware's send.

- **The eager reduce and reduce_scatter** move whole chunks as well: along the
  reduce's chain from the rank after the root, every rank but that first one
  receives (and reduces, and forwards) all `count` elements in one move, and the
  ring reduce_scatter relays each rank's chunk. On the emulator, 4 KiB rx
  buffers: a reduce of 4,096 float32 on 3 ranks and a reduce_scatter of 4,096 per
  rank on 2 time out; a reduce of 4,096 on 2 ranks passes, its root's receive
  taking seconds. Past one rx buffer a reduce runs as reduces of one rx buffer's
  worth each, and a reduce_scatter as one reduce per rank, of that rank's chunk
  to that rank, cut likewise.

A bcast from another root ends each segment's moves on a real one.
"""

from __future__ import annotations

from typing import NamedTuple

from .._constants import TAG_ANY, CompressionFlags, Scenario, StreamFlags
from ..devices import CallArgs

RENDEZVOUS_ONLY = frozenset({Scenario.BARRIER, Scenario.ALLTOALL})
"""Calls the firmware always runs through rendezvous, whatever their size: never on
its TCP and UDP stacks."""
RECEIVING = frozenset({Scenario.SCATTER, Scenario.GATHER, Scenario.REDUCE,
                       Scenario.ALLGATHER, Scenario.REDUCE_SCATTER, Scenario.ALLTOALL,
                       Scenario.ALLREDUCE, Scenario.BCAST})
"""Collectives that nothing is left to do for when `count` is zero."""


CHUNKED = (Scenario.SCATTER, Scenario.GATHER, Scenario.ALLGATHER, Scenario.REDUCE_SCATTER)
"""Collectives whose eager path moves each rank's chunk whole (see `as_sends`)."""


class Refused(ValueError):
    """A call ACCL's firmware cannot run, and no equivalent calls can do for it."""


class Setup(NamedTuple):
    """What the driver configured that decides how the firmware runs a call."""

    bufsize: int  # bytes per eager rx buffer (the firmware's eager_rx_buf_size)
    max_eager_size: int  # bytes: larger uncompressed, unstreamed messages go rendezvous


def ring_segment(bufsize: int, itemsize: int, size: int) -> int:
    """Elements per segment of the eager ring allreduce: one rx buffer's worth,
    rounded down to a multiple of the ranks."""
    fit = bufsize // itemsize
    return fit - fit % size


def ring_rest(elements: int, size: int) -> int:
    """Elements of the last of `size` chunks the ring allreduce cuts `elements` into
    (zero or negative where the others take them all)."""
    return elements - -(-elements // size) * (size - 1)


def allreduce_split(count: int, size: int, segment: int) -> tuple[int, int]:
    """(ring, rest): the firmware's eager ring allreduce runs the first `ring` elements
    right; the last `rest` (its short last segment, when that would leave an empty or
    negative chunk) must go another way. `segment` is `ring_segment(...)`."""
    if size < 2 or count == 0:
        return count, 0
    if segment == 0:
        return 0, count
    last = count - segment * ((count - 1) // segment)
    if ring_rest(last, size) >= 1:
        return count, 0
    return count - last, last


def bcast_repeats(count: int, size: int, root: int, segment: int) -> bool:
    """Whether an eager bcast would re-send its first segment: from the last rank,
    over more than one segment (`segment`: elements per rx buffer)."""
    return size >= 2 and root == size - 1 and count > segment


def substitute(args: CallArgs, size: int, itemsizes: tuple[int, int, int],
               setup: Setup, rank: int | None = None) -> list[CallArgs] | None:
    """Calls that do what `args` asks where ACCL's firmware would hang or give wrong
    data on `args` itself, in the order to run them; None where it runs `args` right.

    `size` is the communicator's and `rank` this rank's place in it (the stand-ins
    for a chunked collective differ by rank), `itemsizes` the element bytes of the buffers at
    addr_0, addr_1 and addr_2 (the first is the arithmetic's, uncompressed, unless
    OP0_COMPRESSED). Raises `Refused` for what no such calls can do.
    """
    scenario = args.scenario
    if scenario not in RECEIVING or size < 2:
        return None
    if args.count == 0:  # nothing to move: nothing to wait for either
        return [args._replace(scenario=Scenario.NOP)]
    if scenario not in (Scenario.ALLREDUCE, Scenario.BCAST, Scenario.REDUCE, *CHUNKED):
        return None
    itemsize = max(itemsizes)  # the arithmetic config's uncompressed element
    if not itemsize:
        return None
    if args.count * itemsize > setup.max_eager_size and not args.compression_flags \
            and not args.stream_flags:
        return None  # rendezvous: a reduce and a bcast, or a tree, no ring
    if scenario in (*CHUNKED, Scenario.REDUCE):
        if args.compression_flags or args.stream_flags or args.count <= setup.bufsize // itemsize:
            return None  # (compressed: left to the firmware, as it stands)
        if scenario == Scenario.REDUCE:
            return _in_rx_buffers(args, size, itemsizes, setup)
        if rank is None:
            return None
        steps = as_sends(args, size, rank, itemsize)
        return [piece for step in steps
                for piece in _in_rx_buffers(step, size, itemsizes, setup) or [step]]
    if scenario == Scenario.BCAST:
        segment = setup.bufsize // itemsize
        if args.stream_flags & StreamFlags.OP0_STREAM \
                or not bcast_repeats(args.count, size, args.root_src_dst, segment):
            return None  # a streamed root sends one segment
        return _pieces(args, segment, itemsizes)
    segment = args.count if args.stream_flags & StreamFlags.OP0_STREAM \
        else ring_segment(setup.bufsize, itemsize, size)
    ring, rest = allreduce_split(args.count, size, segment)
    if not rest:
        return None
    if args.stream_flags:
        raise Refused(f"ACCL's firmware hangs on an allreduce of {args.count} elements on "
                      f"{size} ranks (its ring leaves a chunk empty), and a streamed one "
                      "cannot be split")
    if ring == 0 and segment == 0:
        raise Refused(f"ACCL's firmware cannot run an eager allreduce on {size} ranks with "
                      f"{setup.bufsize}-byte rx buffers: its ring needs {size} elements of "
                      f"{itemsize} bytes per rx buffer (bufsize >= {size * itemsize})")
    return [*([args._replace(count=ring)] if ring else []), *_reduce_then_bcast(args, ring, rest,
                                                                                 itemsizes)]


def as_sends(args: CallArgs, size: int, rank: int, itemsize: int) -> list[CallArgs]:
    """An uncompressed eager scatter, gather or allgather as point-to-point calls (tag
    TAG_ANY, as the firmware's own match). Scatter and gather: the root copies its own
    chunk, and sends each other rank its chunk (scatter) or receives each other
    rank's (gather); the others receive (scatter) or send (gather) theirs.
    Allgather: each rank copies its own chunk, then in step k sends it to the k-th
    next rank and receives the k-th previous one's. Reduce_scatter: a reduce of
    chunk k to rank k, for every rank k in turn."""
    root, chunk = args.root_src_dst, args.count * itemsize
    if args.scenario == Scenario.REDUCE_SCATTER:
        return [args._replace(scenario=Scenario.REDUCE, root_src_dst=k, addr_1=0,
                              addr_0=args.addr_0 + k * chunk,
                              addr_2=args.addr_2 if k == rank else 0) for k in range(size)]
    plain = args._replace(tag=TAG_ANY, addr_1=0)
    if args.scenario == Scenario.SCATTER:
        if rank != root:
            return [plain._replace(scenario=Scenario.RECV, addr_0=0)]
        own = plain._replace(scenario=Scenario.COPY, root_src_dst=0,
                             addr_0=args.addr_0 + root * chunk)
        return [own, *(plain._replace(scenario=Scenario.SEND, root_src_dst=peer,
                                      addr_0=args.addr_0 + peer * chunk, addr_2=0)
                       for peer in range(size) if peer != root)]
    if args.scenario == Scenario.ALLGATHER:
        own = plain._replace(scenario=Scenario.COPY, root_src_dst=0,
                             addr_2=args.addr_2 + rank * chunk)
        steps = [own]
        for k in range(1, size):
            to, frm = (rank + k) % size, (rank - k) % size
            steps += [plain._replace(scenario=Scenario.SEND, root_src_dst=to, addr_2=0),
                      plain._replace(scenario=Scenario.RECV, root_src_dst=frm, addr_0=0,
                                     addr_2=args.addr_2 + frm * chunk)]
        return steps
    if rank != root:
        return [plain._replace(scenario=Scenario.SEND, addr_2=0)]
    own = plain._replace(scenario=Scenario.COPY, root_src_dst=0,
                         addr_2=args.addr_2 + root * chunk)
    return [own, *(plain._replace(scenario=Scenario.RECV, root_src_dst=peer, addr_0=0,
                                  addr_2=args.addr_2 + peer * chunk)
                   for peer in range(size) if peer != root)]


def _in_rx_buffers(args: CallArgs, size: int, itemsizes: tuple[int, int, int],
                   setup: Setup) -> list[CallArgs] | None:
    """A reduce (eager, uncompressed, on 2 ranks or more) past one rx buffer as
    reduces of one rx buffer's worth each; None for any other call."""
    segment = setup.bufsize // max(itemsizes)
    if args.scenario != Scenario.REDUCE or size < 2 or args.count <= segment:
        return None
    return _pieces(args, segment, itemsizes)


def _pieces(args: CallArgs, segment: int, itemsizes: tuple[int, int, int]) -> list[CallArgs]:
    """`args` on consecutive slices of `segment` elements (the last may be shorter)."""
    return [_slice(args, start, min(segment, args.count - start), itemsizes)
            for start in range(0, args.count, segment)]


def _slice(args: CallArgs, start: int, count: int, itemsizes: tuple[int, int, int]) -> CallArgs:
    """`args` on elements [start, start + count) of each of its buffers."""
    a0, a1, a2 = (address + start * item if address else 0
                  for address, item in zip((args.addr_0, args.addr_1, args.addr_2), itemsizes))
    return args._replace(count=count, addr_0=a0, addr_1=a1, addr_2=a2)


def _reduce_then_bcast(args: CallArgs, start: int, count: int,
                       itemsizes: tuple[int, int, int]) -> list[CallArgs]:
    """An allreduce of elements [start, start + count) as a reduce to rank 0 and a
    bcast of its result from there (the firmware's own plan for rendezvous), both
    eager: chunks of `count` whole elements, a first root, no ring."""
    part = _slice(args, start, count, itemsizes)
    reduce = part._replace(scenario=Scenario.REDUCE, root_src_dst=0, addr_1=0)
    flags = CompressionFlags(args.compression_flags)
    wire = flags & CompressionFlags.ETH_COMPRESSED
    if flags & CompressionFlags.RES_COMPRESSED:  # the bcast reads and writes the result
        wire |= CompressionFlags.OP0_COMPRESSED | CompressionFlags.RES_COMPRESSED
    bcast = part._replace(scenario=Scenario.BCAST, root_src_dst=0, function=0,
                          compression_flags=int(wire), addr_0=part.addr_2, addr_1=0)
    return [reduce, bcast]
