"""examples/data_parallel.py: data-parallel SGD with each bucket's allreduce overlapped
with the backward pass.

The training runs in process on a tiny model (both backends, each mode), and must
leave every rank with bitwise identical weights that match a single-process numpy
run of the whole batches; a probe kernel shows that the first bucket's allreduce
finishes while the first layer's backward kernel still runs. The script runs once
end to end (with its loss plot and trace) and once under `aaccl launch -n 2`.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import example_module

import aaccl

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


dp = example_module("data_parallel")
OVERLAP, SEQUENTIAL = dp.OVERLAP, dp.SEQUENTIAL
TINY = dp.Config(widths=(8, 32, 24, 4), batch=4, steps=6, lr=0.1, bucket_size=1 << 10,
                 batches=3, warmup=1)
TINY_ARGS = ["--widths", "8-32-24-4", "--batch", "4", "--steps", "6", "--warmup", "1",
             "--bucket-size", "1K"]


def train(config: dp.Config, ranks: int, modes: tuple[str, ...],
          backend: str = "asyncio") -> list:
    async def rank(accl: aaccl.ACCL) -> dp.RankResult:
        return await dp.train(accl, config, modes)

    return aaccl.run(rank, world_size=ranks, backend=backend)


# -- the model's layout ------------------------------------------------------------------------

def test_layers_sit_last_first_and_buckets_are_contiguous() -> None:
    layers = dp.layout((8, 32, 24, 4))
    assert [layer.index for layer in layers] == [1, 2, 3]
    assert [layer.offset for layer in layers] == [4 + 24 * 4 + 24 + 32 * 24, 4 * 24 + 4, 0]
    flat = np.arange(sum(layer.size for layer in layers))
    for layer in layers:  # W then b, one slice of the flat vector
        assert layer.weight(flat).shape == (layer.fan_in, layer.fan_out)
        assert layer.bias(flat)[0] == layer.weight(flat)[-1, -1] + 1


@pytest.mark.parametrize(("cap", "groups"), [
    (0, [(3,), (2,), (1,)]),  # a bucket per layer
    (4 * (24 * 4 + 4), [(3,), (2,), (1,)]),  # layer 3 alone reaches the cap
    (4 * (24 * 4 + 4) + 1, [(3, 2), (1,)]),  # DDP: fill up to at least the cap
    (1 << 30, [(3, 2, 1)]),  # one bucket: nothing left to overlap with
])
def test_buckets_fill_up_to_the_cap_from_the_last_layer(cap: int,
                                                       groups: list[tuple[int, ...]]) -> None:
    layers = dp.layout((8, 32, 24, 4))
    found = dp.buckets(layers, cap)
    assert [b.layers for b in found] == groups
    assert found[0].start == 0 and found[-1].stop == sum(layer.size for layer in layers)
    assert all(a.stop == b.start for a, b in itertools.pairwise(found))


def test_the_default_model_has_three_buckets() -> None:
    found = dp.buckets(dp.layout(dp.Config().widths), dp.Config().bucket_size)
    assert [b.layers for b in found] == [(4, 3), (2,), (1,)]


# -- training in process --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ranks_agree_bitwise_and_with_one_process(backend: str) -> None:
    results = train(TINY, 3, (OVERLAP, SEQUENTIAL), backend)
    assert [r.rank for r in results] == [0, 1, 2]
    summary = dp.check(results, TINY, rtol=1e-5, atol=1e-7)
    assert "identical" in summary
    expected, losses = dp.reference(TINY, 3)
    assert not np.array_equal(expected, dp.initial_parameters(TINY))  # it trained
    np.testing.assert_allclose(results[2].params, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dp.mean_loss(results), losses, rtol=1e-5)
    assert all(len(r.times[OVERLAP]) == len(r.times[SEQUENTIAL]) == 2 for r in results)


def test_both_modes_do_the_same_arithmetic() -> None:
    """Overlapping changes when the allreduces run, not what they sum: the modes give
    the same weights, bit for bit, alone or taking turns."""
    runs = [train(TINY, 2, modes) for modes in [(OVERLAP,), (SEQUENTIAL,), (OVERLAP, SEQUENTIAL)]]
    for results in runs[1:]:
        assert np.array_equal(results[0].params, runs[0][0].params)
        assert np.array_equal(results[1].losses, runs[0][1].losses)


def test_the_check_catches_ranks_that_differ() -> None:
    results = train(TINY, 2, (OVERLAP,))
    results[1].params[5] = np.nextafter(results[1].params[5], np.float32(np.inf))
    with pytest.raises(AssertionError, match="rank 1's weights differ"):
        dp.check(results, TINY, rtol=1e-4, atol=1e-6)


def test_an_allreduce_finishes_while_the_backward_pass_goes_on() -> None:
    """The first layer's backward kernel waits (up to 10 s) until the first bucket's
    allreduce is done on its rank: that happens only if the allreduce ran while the
    backward pass was still under way."""
    config = TINY
    seen: dict[int, bool] = {}

    class Probe(dp.Trainer):
        def allreduce(self, bucket: dp.Bucket, waitfor=()) -> aaccl.Call:
            call = super().allreduce(bucket, waitfor)
            if bucket is self.buckets[0]:
                self.first = call
            return call

        def backward_layer(self, layer: dp.Layer, step: int, after: aaccl.Call) -> aaccl.Call:
            if layer.index != 1:
                return super().backward_layer(layer, step, after)
            first, rank = self.first, self.accl.rank

            def wait_then_backward(*args: np.ndarray) -> None:
                deadline = time.monotonic() + 10
                while not first.done() and time.monotonic() < deadline:
                    time.sleep(0.001)
                seen[rank] = first.done()
                dp.backward(*args, None)

            batch = step % config.batches
            return self.accl.kernel(wait_then_backward)(
                self.x[batch], self.deltas[1], layer.weight(self.params),
                layer.weight(self.grads), layer.bias(self.grads), waitfor=[after])

    async def rank(accl: aaccl.ACCL) -> None:
        trainer = Probe(accl, config)
        assert len(trainer.buckets) == 2 and trainer.buckets[-1].layers == (1,)
        await trainer.upload()
        await trainer.overlapped_step(0)

    aaccl.run(rank, world_size=2)
    assert seen == {0: True, 1: True}


# -- the script ------------------------------------------------------------------------------

def script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLES / "data_parallel.py"), *args],
                          check=False, capture_output=True, text=True, timeout=120)


def test_script_trains_checks_plots_and_traces(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png, trace = tmp_path / "loss.png", tmp_path / "trace.json"
    done = script("--ranks", "2", *TINY_ARGS, "--plot", str(png), "--trace", str(trace))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "data-parallel SGD on 2 ranks (in process" in out
    for label in ("overlapped", "sequential", "overlap saves", "identical (bitwise)"):
        assert label in out
    assert out.rstrip().endswith(": ok")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"allreduce", "kernel backward", "kernel forward", "kernel sgd"} <= names
    assert not any("sync_from_device" in name for name in names)  # the steps only
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_script_no_overlap_and_usage_errors() -> None:
    done = script("--ranks", "2", *TINY_ARGS, "--no-overlap", "--backend", "trio")
    assert done.returncode == 0, done.stderr
    assert "sequential" in done.stdout and "overlapped" not in done.stdout
    bad = script("--widths", "8")
    assert bad.returncode == 2 and "widths" in bad.stderr


def test_under_aaccl_launch_rank_0_reports_once(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    from test_mpi_fabric import MPIEXEC, run_job  # here: it needs mpi4py

    if MPIEXEC is None:
        pytest.skip("no mpiexec (pip install 'aaccl[mpi]')")
    trace = tmp_path / "trace.json"
    job = run_job([sys.executable, "-m", "aaccl", "launch", "-n", "2",
                   str(EXAMPLES / "data_parallel.py"), *TINY_ARGS, "--trace", str(trace)],
                  limit=120)
    assert job.returncode == 0, job.explain()
    assert job.stdout.count("data-parallel SGD on 2 ranks (one per process") == 1, job.explain()
    assert job.stdout.rstrip().endswith(": ok"), job.explain()
    events = json.loads(trace.read_text())["traceEvents"]  # rank 0 wrote every rank's calls
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
