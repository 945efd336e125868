"""`aaccl trace plot trace.json -o timeline.png`: a call timeline as a picture.

One row per rank and lane (the host's waits and submissions, each engine's calls),
time across, one colour per operation: overlap between compute, communication and
the host shows as bars stacked in time, as in ACCL's overlap diagrams.
"""

from __future__ import annotations

import json
import os
from typing import Any


def lanes_of(trace: dict[str, Any]) -> tuple[list[tuple[int, int, str]], list[dict[str, Any]]]:
    """The trace's lanes as (pid, tid, label) in drawing order, and its spans."""
    threads: dict[tuple[int, int], str] = {}
    processes: dict[int, str] = {}
    spans = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event["pid"], event["tid"])] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif event.get("ph") == "X":
            spans.append(event)
            threads.setdefault((event["pid"], event["tid"]), str(event["tid"]))
    lanes = [(pid, tid, f"{processes.get(pid, f'rank {pid}')} {name}")
             for (pid, tid), name in sorted(threads.items(), key=lambda kv: (kv[0][0], kv[1]))]
    return lanes, spans


def plot(trace_path: str | os.PathLike[str], out: str | os.PathLike[str],
         title: str | None = None) -> None:
    """Draw the Chrome/Perfetto trace at `trace_path` as a PNG timeline at `out`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'aaccl[plot]'") from None
    with open(trace_path) as f:
        lanes, spans = lanes_of(json.load(f))
    if not spans:
        raise ValueError(f"{trace_path} has no calls to draw")
    row = {(pid, tid): i for i, (pid, tid, _) in enumerate(lanes)}
    names = sorted({s["name"].split(" ", 1)[-1] if s["name"].startswith(("await ", "submit "))
                    else s["name"] for s in spans})
    colours = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(names)}
    t0 = min(s["ts"] for s in spans)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(lanes) + 1.5))
    for span in spans:
        name = span["name"]
        op = name.split(" ", 1)[-1] if name.startswith(("await ", "submit ")) else name
        y = row[(span["pid"], span["tid"])]
        hatch = "//" if name.startswith("await ") else None
        ax.broken_barh([((span["ts"] - t0) / 1000, max(span["dur"] / 1000, 1e-3))],
                       (y - 0.4, 0.8), facecolors=colours[op], edgecolor="black",
                       linewidth=0.3, hatch=hatch)
    ax.set_yticks(range(len(lanes)), [label for *_, label in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or os.path.basename(os.fspath(trace_path)))
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small",
              title="hatched: host awaits")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
