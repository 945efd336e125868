"""Killed processes over the MPI fabric: how fast survivors fail, and that nothing is left.

    python benchmarks/bench_faults.py                   # 10 trials, 4 processes, aaccl launch
    python benchmarks/bench_faults.py --trials 20 --procs 3 --signal TERM
    python benchmarks/bench_faults.py --launcher mpiexec   # plain `mpiexec -n N python ...`
    python benchmarks/bench_faults.py --env UCX_TLS=^cma   # try a transport setting
    python benchmarks/bench_faults.py --json -          # machine-readable results on stdout

Each trial starts a job whose ranks run 16 MiB float32 allreduces (`--size-mib`) in a
loop with `timeout=5` (`--timeout`), waits until every rank has finished its first
one, then, after a random pause of up to half a second, kills a random rank with
SIGKILL or SIGTERM (alternating with `--signal both`, the default). It records:

- which rank, which signal;
- the time from the kill to the first survivor's report (a rank prints one line when
  its allreduce fails, naming the error), and how many survivors reported;
- the time from the kill to the job's exit, and its exit status;
- leftovers: processes of the job (ranks, hydra's proxies, mpiexec) still alive when
  the job has exited; they are killed before the next trial.

A job that has not exited `--grace` seconds (default 15) after the timeout is a hang:
it is killed and counted. The summary gives the medians and worst cases, and how
many trials hung, exited with status 0, or left processes behind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from _procs import LiveJob, alive, descendants, kill, with_marker

MARK = "aaccl-fault"
MiB = 1 << 20
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}


# -- worker (one per MPI process) ---------------------------------------------------------


def worker(size_mib: float, timeout: float) -> None:
    """Allreduce in a loop until a peer dies; print one line when ready, one on failure."""
    import numpy as np

    import aaccl
    from aaccl import ReduceFunction

    count = int(size_mib * MiB) // 4

    async def main(accl: aaccl.ACCL) -> None:
        src, dst = accl.allocate(count, np.float32), accl.allocate(count, np.float32)
        src[:] = 1
        src.sync_to_device()
        rounds = 0
        while True:
            try:
                await accl.allreduce(src, dst, count, ReduceFunction.SUM, from_fpga=True,
                                     to_fpga=True)
            except Exception as exc:
                _say(f"{MARK}-error rank={accl.rank} pid={os.getpid()} round={rounds} "
                     f"t={time.time():.3f} {type(exc).__name__}: {exc}")
                raise
            rounds += 1
            if rounds == 1:
                _say(f"{MARK}-ready rank={accl.rank} pid={os.getpid()}")

    aaccl.run(main, timeout=timeout)


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# -- one trial ----------------------------------------------------------------------------


def job_command(launcher: str, procs: int, size_mib: float, timeout: float,
                marker: str) -> list[str]:
    here = os.path.abspath(__file__)
    program = [here, "--worker", "--size-mib", str(size_mib), "--timeout", str(timeout),
               "--marker", marker]
    if launcher == "aaccl":
        return [sys.executable, "-m", "aaccl", "launch", "-n", str(procs), *program]
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(procs),
            sys.executable, *program]


def trial(launcher: str, procs: int, size_mib: float, timeout: float, grace: float,
          sig: str, rng: random.Random, env: dict[str, str]) -> dict[str, Any]:
    marker = uuid.uuid4().hex
    cmd = job_command(launcher, procs, size_mib, timeout, marker)
    job_run = LiveJob(cmd, {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                            **env})
    proc, lines = job_run.proc, job_run.lines
    result: dict[str, Any] = {"signal": sig, "launcher": launcher, "procs": procs}

    def ready() -> dict[int, int]:
        found = {}
        for _, line in list(lines):
            if line.startswith(f"{MARK}-ready "):
                fields = dict(f.split("=", 1) for f in line.split()[1:])
                found[int(fields["rank"])] = int(fields["pid"])
        return found

    start_by = time.monotonic() + 60
    while len(ready()) < procs and proc.poll() is None and time.monotonic() < start_by:
        time.sleep(0.01)
    pids = ready()
    if len(pids) < procs:
        _kill(proc.pid, marker, set())
        proc.wait()
        result["error"] = f"only ranks {sorted(pids)} started (exit {proc.returncode}): " \
                          + job_run.stderr[-500:]
        return result
    time.sleep(rng.uniform(0, 0.5))
    job = descendants(proc.pid) | {proc.pid}
    victim = rng.randrange(procs)
    result.update(rank=victim, pid=pids[victim])
    killed = time.monotonic()
    os.kill(pids[victim], SIGNALS[sig])
    try:
        proc.wait(timeout + grace)
        result["hang"] = False
    except subprocess.TimeoutExpired:
        result["hang"] = True
        result["left_at_limit"] = sorted(p for p in descendants(proc.pid) | {proc.pid}
                                         | with_marker(marker) if alive(p))
        _kill(proc.pid, marker, job)
        proc.wait()
    ended = time.monotonic()
    job |= set(pids.values())
    leftovers = sorted(p for p in job | with_marker(marker) if p != proc.pid and alive(p))
    _kill(proc.pid, marker, job)
    job_run.join(5)
    reports = {}
    for when, line in lines:
        if line.startswith(f"{MARK}-error "):
            fields = line.split()
            rank = int(fields[1].split("=", 1)[1])
            if rank != victim and rank not in reports:
                reports[rank] = (when - killed, " ".join(fields[5:]))
    result.update(
        exit=proc.returncode, exit_s=ended - killed, reported=len(reports),
        survivors=procs - 1,
        first_report_s=min((r[0] for r in reports.values()), default=None),
        last_report_s=max((r[0] for r in reports.values()), default=None),
        errors={rank: text[:200] for rank, (_, text) in sorted(reports.items())},
        leftovers=leftovers, stderr_tail=job_run.stderr[-4000:])
    return result


def _kill(pid: int, marker: str, known: set[int]) -> None:
    kill({pid} | known | descendants(pid) | with_marker(marker))


# -- report -------------------------------------------------------------------------------


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def print_trial(i: int, t: dict[str, Any]) -> None:
    if "error" in t:
        print(f"{i:>3}  did not start: {t['error']}", flush=True)
        return
    print(f"{i:>3}  rank {t['rank']}  SIG{t['signal']:<5}  first report {_fmt(t['first_report_s']):>6} s"
          f"  ({t['reported']}/{t['survivors']} survivors)  job exit {_fmt(t['exit_s']):>6} s"
          f"  status {t['exit']:>4}  {'HANG  ' if t['hang'] else ''}"
          f"leftovers {len(t['leftovers'])}", flush=True)


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [t for t in trials if "error" not in t]

    def stats(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        values = sorted(values)
        return {"median": values[len(values) // 2], "max": values[-1], "min": values[0]}

    return {
        "trials": len(trials), "ran": len(ran),
        "hangs": sum(t["hang"] for t in ran),
        "exit_zero": sum(t["exit"] == 0 for t in ran),
        "with_leftovers": sum(bool(t["leftovers"]) for t in ran),
        "survivors": sum(t["survivors"] for t in ran),
        "survivors_reported": sum(t["reported"] for t in ran),
        "first_report_s": stats([t["first_report_s"] for t in ran
                                 if t["first_report_s"] is not None]),
        "exit_s": stats([t["exit_s"] for t in ran]),
        "exit_statuses": sorted({t["exit"] for t in ran}),
    }


def print_summary(s: dict[str, Any], timeout: float) -> None:
    def span(stat: dict[str, float] | None) -> str:
        return "-" if stat is None else \
            f"median {stat['median']:.2f} s, min {stat['min']:.2f} s, max {stat['max']:.2f} s"

    print(f"\n{s['ran']} of {s['trials']} trials ran; timeout {timeout:g} s")
    print(f"  survivors that reported their error: {s['survivors_reported']} of {s['survivors']}")
    print(f"  kill -> first survivor report: {span(s['first_report_s'])}")
    print(f"  kill -> job exit:              {span(s['exit_s'])}")
    print(f"  exit statuses: {s['exit_statuses']}; exit 0: {s['exit_zero']}; hangs: {s['hangs']}; "
          f"trials with leftover processes: {s['with_leftovers']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--size-mib", type=float, default=16)
    parser.add_argument("--timeout", type=float, default=5.0, help="aaccl's timeout (s)")
    parser.add_argument("--grace", type=float, default=15.0,
                        help="seconds past the timeout after which a job counts as hung")
    parser.add_argument("--signal", choices=["both", "KILL", "TERM"], default="both")
    parser.add_argument("--launcher", choices=["aaccl", "mpiexec"], default="aaccl")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the job (repeatable)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--marker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.size_mib, args.timeout)
        return 0
    env = dict(item.split("=", 1) for item in args.env)
    rng = random.Random(args.seed)
    trials = []
    print(f"{args.trials} trials: {args.procs} processes ({args.launcher} launch), "
          f"{args.size_mib:g} MiB allreduces, timeout {args.timeout:g} s, env {env or 'as is'}",
          flush=True)
    for i in range(args.trials):
        sig = args.signal if args.signal != "both" else ("KILL", "TERM")[i % 2]
        t = trial(args.launcher, args.procs, args.size_mib, args.timeout, args.grace, sig, rng,
                  env)
        trials.append(t)
        print_trial(i + 1, t)
    s = summary(trials)
    print_summary(s, args.timeout)
    if args.json is not None:
        text = json.dumps({"config": vars(args), "trials": trials, "summary": s}, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
