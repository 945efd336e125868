"""Rank numbers in words: lists of ranks as ranges, and messages with their rank
numbers taken out (to tell whether two ranks' errors are the same one).

Shared by `aaccl.run`'s errors and the pytest plugin's reports, so that both print
64 ranks as one short line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_RANKS = re.compile(r"\b(?:ranks?) \d+(?:(?:, | and |-)\d+)*")
_PEER_ARGS = re.compile(r"\b(src|dst)=\d+")


def ranges(numbers: Iterable[int], most: int = 12) -> str:
    """`rank 3`, `ranks 0, 1`, `ranks 0-36, 38-63`: runs of three or more as ranges,
    so that a list of 64 ranks stays one line; past `most` parts, the first ones and
    how many ranks in all (`ranks 0, 2, 4, ..., 62 (32 ranks)`)."""
    numbers = sorted(numbers)
    parts: list[str] = []
    run: list[int] = []
    for n in [*numbers, None]:
        if run and (n is None or n != run[-1] + 1):
            parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(k) for k in run]
            run = []
        if n is not None:
            run.append(n)
    if len(parts) > most:
        parts = [*parts[:most - 2], "...", parts[-1]]
        return "ranks " + ", ".join(parts) + f" ({len(numbers)} ranks)"
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(parts)


def without_ranks(text: str) -> str:
    """`text` with every rank number it names replaced by `#`: `allreduce (rank 2,
    call 1) ... waited 1 s for rank 3`, `recv(src=3, ...)` read the same on every rank
    (a rank names itself, and the peers it waited for, by number)."""
    return _PEER_ARGS.sub(r"\1=#", _RANKS.sub("rank #", text))
