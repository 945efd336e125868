"""Data-parallel training of a small numpy MLP, with each bucket of gradients
allreduced while the backward pass goes on, as PyTorch's DistributedDataParallel does.

Usage::

    python examples/data_parallel.py [--ranks N] [--steps K] [--bucket-size 1M] ...
    aaccl launch -n 2 examples/data_parallel.py ...  # a rank per process

Every rank holds the same model (a ReLU MLP, 32-512-512-512-32 by default) and its
shard of every global batch of a synthetic regression task (fixed seed). A training
step is a graph of calls on the rank's device, all on device-resident buffers:

- forward: one kernel per layer, then a kernel for the loss and its gradient;
- backward, from the last layer: one kernel per layer, writing that layer's weight
  and bias gradients into one flat gradient buffer (laid out last layer first, so
  that layers finishing together sit together);
- as soon as the backward kernels of a bucket of layers are submitted (a bucket
  fills up to `--bucket-size` bytes, as DDP's bucket_cap_mb), its slice of the
  gradient buffer is allreduced in place (SUM, on the device), without waiting;
  an SGD kernel chained to that allreduce divides by N and updates the bucket's
  slice of the flat parameter buffer;
- one ``await accl.nop(waitfor=[...])`` ends the step.

The device runs the allreduce of the last layers while its workers compute the
gradients of the first ones: the kernels of a layer touch only that layer's slices,
so the hazard rule (a kernel writes every Buffer it is given) never serializes them
with the allreduce of another bucket. The sequential baseline (``--no-overlap``)
runs the same calls, but awaits the whole backward pass before the allreduces and
each allreduce before the next. By default both modes take turns, step by step,
in one run (the same arithmetic, so they train the same model), and the step time
of each is printed: median, interquartile range and minimum over the timed steps,
of the slowest rank, and how many cores the step kept busy (CPU time over wall
time, of every process).

With ``--check`` (the default), every rank's final weights must be bitwise
identical, and equal to those of a single-process full-batch numpy run of the same
steps within ``--rtol``. ``--plot FILE.png`` draws the loss curve; ``--trace
FILE.json`` records a call timeline of the last steps (one of each mode) for
``aaccl trace plot`` (of every rank: under ``aaccl launch`` rank 0 gathers them).

What limits the overlap here (docs/overlap.md has the numbers): on the soft CCLO
the allreduce runs on the host's cores, like the compute kernels of every rank. In
one process the ranks also share one interpreter, whose GIL the Python of every
call holds: the process keeps about 1.2 of 2 cores busy either way, and overlap
gains nothing measurable. One rank per process (``aaccl launch``) uses both cores,
and overlap pays once there are more processes than cores (a collective waits for
every process to get a core: once per step instead of once per bucket). On an FPGA
the CCLO, not the host, runs the collective. BLAS gets one thread
(``OPENBLAS_NUM_THREADS=1`` unless set; ``aaccl launch`` sets it to the cores per
rank): one core per kernel.
"""

from __future__ import annotations

import os
import sys

# One BLAS thread per kernel (before numpy loads BLAS; `aaccl launch` sets it to the
# machine's cores per rank)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

import aaccl
from aaccl import ReduceFunction

OVERLAP, SEQUENTIAL = "overlapped", "sequential"


# -- the model and the task -----------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (32, 512, 512, 512, 32)  # input, hidden..., output
    batch: int = 32  # samples per rank per step: the global batch is ranks * batch
    steps: int = 50
    lr: float = 0.05
    bucket_size: int = 1 << 20  # bytes: a bucket fills up to at least this (DDP's cap)
    batches: int = 16  # global batches in the data set, cycled
    warmup: int = 2  # steps of each mode not timed
    seed: int = 0

    @property
    def layers(self) -> int:
        return len(self.widths) - 1


@dataclass(frozen=True)
class Layer:
    """Layer l (1-based) of the MLP: W_l (fan_in x fan_out) and b_l, at `offset` in
    the flat parameter and gradient vectors (W first, then b)."""

    index: int
    fan_in: int
    fan_out: int
    offset: int

    @property
    def size(self) -> int:
        return self.fan_in * self.fan_out + self.fan_out

    def weight(self, flat: np.ndarray) -> np.ndarray:
        return flat[self.offset:self.offset + self.fan_in * self.fan_out].reshape(
            self.fan_in, self.fan_out)

    def bias(self, flat: np.ndarray) -> np.ndarray:
        start = self.offset + self.fan_in * self.fan_out
        return flat[start:start + self.fan_out]


@dataclass(frozen=True)
class Bucket:
    """Consecutive layers, in backward order, whose gradients are allreduced together:
    flat[start:stop]."""

    layers: tuple[int, ...]
    start: int
    stop: int


def layout(widths: Sequence[int]) -> list[Layer]:
    """Layers 1..L, the last one first in the flat vectors: backward fills them front
    to back, so every bucket is one contiguous slice."""
    layers, offset = [], 0
    for index in range(len(widths) - 1, 0, -1):
        layer = Layer(index, widths[index - 1], widths[index], offset)
        layers.append(layer)
        offset += layer.size
    return sorted(layers, key=lambda layer: layer.index)


def buckets(layers: Sequence[Layer], cap: int, itemsize: int = 4) -> list[Bucket]:
    """Group layers, from the last, into buckets of at least `cap` bytes (the last
    bucket may be smaller), as DDP does: 0 gives each layer a bucket of its own."""
    out: list[Bucket] = []
    group: list[Layer] = []
    for layer in sorted(layers, key=lambda layer: -layer.index):
        group.append(layer)
        if sum(g.size for g in group) * itemsize >= cap or layer.index == 1:
            out.append(Bucket(tuple(g.index for g in group), group[0].offset,
                              group[-1].offset + group[-1].size))
            group = []
    return out


def initial_parameters(config: Config) -> np.ndarray:
    """He-initialised weights (the last layer's a tenth of that, so that the untrained
    model predicts about 0) and zero biases, as one flat float32 vector."""
    rng = np.random.default_rng(config.seed)
    layers = layout(config.widths)
    flat = np.zeros(sum(layer.size for layer in layers), np.float32)
    for layer in layers:
        scale = np.sqrt(2.0 / layer.fan_in) * (0.1 if layer.index == config.layers else 1.0)
        layer.weight(flat)[:] = rng.standard_normal((layer.fan_in, layer.fan_out)) * scale
    return flat


def dataset(config: Config, nranks: int) -> tuple[np.ndarray, np.ndarray]:
    """`batches` global batches (X, Y) of nranks * batch samples: Y is a random
    two-layer tanh network (4 hidden units) of X, plus a little noise."""
    rng = np.random.default_rng(config.seed + 1)
    n_in, n_out = config.widths[0], config.widths[-1]
    shape = (config.batches, nranks * config.batch)
    x = rng.standard_normal((*shape, n_in)).astype(np.float32)
    teacher_1 = rng.standard_normal((n_in, 4)) / np.sqrt(n_in)
    teacher_2 = rng.standard_normal((4, n_out)) / 2
    y = np.tanh(x @ teacher_1) @ teacher_2 + 0.01 * rng.standard_normal((*shape, n_out))
    return x, y.astype(np.float32)


def shard(data: np.ndarray, rank: int, batch: int) -> np.ndarray:
    """Rank `rank`'s samples of every global batch."""
    return np.ascontiguousarray(data[:, rank * batch:(rank + 1) * batch])


# -- the kernels: numpy on device memory, few long calls that release the GIL ------------------

def forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, out: np.ndarray, relu: bool) -> None:
    """out = relu(x @ w + b) (no relu on the last layer)."""
    np.matmul(x, w, out=out)
    out += b
    if relu:
        np.maximum(out, 0, out=out)


def loss(out: np.ndarray, y: np.ndarray, delta: np.ndarray, value: np.ndarray) -> None:
    """The mean squared error over this rank's samples and outputs into value[0],
    and its gradient with respect to `out` into `delta`."""
    np.subtract(out, y, out=delta)
    value[0] = np.vdot(delta, delta) / delta.size
    delta *= np.float32(2 / delta.size)


def backward(a_prev: np.ndarray, delta: np.ndarray, w: np.ndarray, dw: np.ndarray,
             db: np.ndarray, delta_prev: np.ndarray | None) -> None:
    """A layer's weight and bias gradients from its input and the gradient at its
    output; and (but for the first layer) the gradient at the layer below's output,
    through the ReLU."""
    np.matmul(a_prev.T, delta, out=dw)
    np.sum(delta, axis=0, out=db)
    if delta_prev is not None:
        np.matmul(delta, w.T, out=delta_prev)
        np.multiply(delta_prev, a_prev > 0, out=delta_prev)


def sgd(params: np.ndarray, grads: np.ndarray, scale: float) -> None:
    """params -= scale * grads, with scale = lr / N: the summed gradients become
    their mean over the ranks here."""
    grads *= np.float32(scale)
    params -= grads


# -- one rank -------------------------------------------------------------------------------------

@dataclass
class RankResult:
    """What a rank hands back (under launch, to every process): its final weights,
    losses, step times and, if traced, its calls in the last steps."""

    rank: int
    params: np.ndarray  # the final weights
    losses: np.ndarray  # this rank's loss at every step (on its shard)
    times: dict[str, list[float]] = field(default_factory=dict)  # seconds per timed step
    cpu: dict[str, list[float]] = field(default_factory=dict)  # its process's CPU seconds
    windows: list[tuple[int, int]] = field(default_factory=list)  # each step's perf_counter_ns
    pid: int = field(default_factory=os.getpid)
    spans: list[tuple] = field(default_factory=list)  # its calls in the last steps, if traced


class Trainer:
    """One rank's model, data and kernels in device memory, and its training step."""

    def __init__(self, accl: aaccl.ACCL, config: Config) -> None:
        self.accl, self.config = accl, config
        self.layers = layout(config.widths)
        self.buckets = buckets(self.layers, config.bucket_size)
        n, b, widths = accl.size, config.batch, config.widths
        x, y = dataset(config, n)
        self.x = accl.allocate(shard(x, accl.rank, b).shape)
        self.y = accl.allocate(shard(y, accl.rank, b).shape)
        self.x[:], self.y[:] = shard(x, accl.rank, b), shard(y, accl.rank, b)
        self.params = accl.allocate(sum(layer.size for layer in self.layers))
        self.params[:] = initial_parameters(config)
        self.grads = accl.allocate(self.params.size)
        # acts[l] is layer l's output (acts[0], the input, is a slice of x per step);
        # deltas[l] the loss's gradient at layer l's output, before its ReLU
        self.acts = [None] + [accl.allocate((b, w)) for w in widths[1:]]
        self.deltas = [None] + [accl.allocate((b, w)) for w in widths[1:]]
        self.losses = accl.allocate(config.steps)
        self.k_forward, self.k_loss = accl.kernel(forward), accl.kernel(loss)
        self.k_backward, self.k_sgd = accl.kernel(backward), accl.kernel(sgd)

    async def upload(self) -> None:
        await self.accl.nop(waitfor=[self.accl.sync_to_device(buf)
                                     for buf in (self.x, self.y, self.params)])

    async def download(self) -> None:
        await self.accl.nop(waitfor=[self.accl.sync_from_device(self.params),
                                     self.accl.sync_from_device(self.losses)])

    def forward_and_loss(self, step: int) -> aaccl.Call:
        """Submit the forward kernels and the loss kernel, a chain; return its last call."""
        batch = step % self.config.batches
        acts, last = self.acts, self.config.layers
        done: list[aaccl.Call] = []
        for layer in self.layers:
            source = self.x[batch] if layer.index == 1 else acts[layer.index - 1]
            done = [self.k_forward(source, layer.weight(self.params), layer.bias(self.params),
                                   acts[layer.index], layer.index < last, waitfor=done)]
        return self.k_loss(acts[last], self.y[batch], self.deltas[last],
                           self.losses[step:step + 1], waitfor=done)

    def backward_layer(self, layer: Layer, step: int, after: aaccl.Call) -> aaccl.Call:
        """Submit layer's backward kernel, to run after `after`."""
        batch = step % self.config.batches
        i = layer.index
        a_prev = self.x[batch] if i == 1 else self.acts[i - 1]
        return self.k_backward(a_prev, self.deltas[i], layer.weight(self.params),
                               layer.weight(self.grads), layer.bias(self.grads),
                               self.deltas[i - 1] if i > 1 else None, waitfor=[after])

    def allreduce(self, bucket: Bucket, waitfor: Sequence[aaccl.Call] = ()) -> aaccl.Call:
        """Sum the bucket's gradients over the ranks, in place in device memory."""
        grads = self.grads[bucket.start:bucket.stop]
        return self.accl.allreduce(grads, grads, grads.size, ReduceFunction.SUM,
                                   from_fpga=True, to_fpga=True, waitfor=waitfor)

    def update(self, bucket: Bucket, waitfor: Sequence[aaccl.Call] = ()) -> aaccl.Call:
        """The SGD step of the bucket's parameters from its summed gradients."""
        return self.k_sgd(self.params[bucket.start:bucket.stop],
                          self.grads[bucket.start:bucket.stop],
                          self.config.lr / self.accl.size, waitfor=waitfor)

    async def overlapped_step(self, step: int) -> None:
        """Each bucket's allreduce is submitted right behind the backward kernel of
        its first layer, its update right behind it; one await for the whole step."""
        closes = {bucket.layers[-1]: bucket for bucket in self.buckets}  # by its last layer
        done = self.forward_and_loss(step)
        updates = []
        for layer in reversed(self.layers):
            done = self.backward_layer(layer, step, done)
            if layer.index in closes:
                reduced = self.allreduce(closes[layer.index], waitfor=[done])
                updates.append(self.update(closes[layer.index], waitfor=[reduced]))
        await self.accl.nop(waitfor=updates)

    async def sequential_step(self, step: int) -> None:
        """The baseline: the whole backward pass, then each bucket's allreduce in turn,
        awaited, then the updates."""
        done = self.forward_and_loss(step)
        for layer in reversed(self.layers):
            done = self.backward_layer(layer, step, done)
        await done
        for bucket in self.buckets:
            await self.allreduce(bucket)
        await self.accl.nop(waitfor=[self.update(bucket) for bucket in self.buckets])


def schedule(steps: int, modes: Sequence[str]) -> list[str]:
    """Which mode runs each step: the modes take turns."""
    return [modes[k % len(modes)] for k in range(steps)]


async def train(accl: aaccl.ACCL, config: Config, modes: Sequence[str],
                trace: aaccl.Trace | None = None) -> RankResult:
    """Train for config.steps steps, the modes taking turns; time every step. With a
    `trace` being recorded, keep this rank's spans of the last steps (one per mode)."""
    trainer = Trainer(accl, config)
    await trainer.upload()
    result = RankResult(accl.rank, np.empty(0), np.empty(0), {mode: [] for mode in modes},
                        {mode: [] for mode in modes})
    seen = dict.fromkeys(modes, 0)
    for step, mode in enumerate(schedule(config.steps, modes)):
        start, cpu = time.perf_counter_ns(), time.process_time()
        if mode == OVERLAP:
            await trainer.overlapped_step(step)
        else:
            await trainer.sequential_step(step)
        end, cpu = time.perf_counter_ns(), time.process_time() - cpu
        result.windows.append((start, end))
        seen[mode] += 1
        if seen[mode] > config.warmup:
            result.times[mode].append((end - start) / 1e9)
            result.cpu[mode].append(cpu)
    if trace is not None:  # from the step before them: its last calls may still run
        since = result.windows[max(0, config.steps - len(modes) - 1)][0]
        result.spans = [(s.engine, s.name, s.start, s.end, s.args) for s in list(trace.spans)
                        if s.rank == accl.rank and s.end > since]
    await trainer.download()
    result.params, result.losses = np.array(trainer.params), np.array(trainer.losses)
    return result


# -- the single-process reference ------------------------------------------------------------------

def reference(config: Config, nranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The same steps on the whole global batch in one process: (final weights,
    loss at every step)."""
    layers = layout(config.widths)
    params = initial_parameters(config)
    grads = np.zeros_like(params)
    x, y = dataset(config, nranks)
    losses = np.zeros(config.steps, np.float32)
    n = nranks * config.batch
    acts = [np.zeros((n, w), np.float32) for w in config.widths]
    deltas = [np.zeros((n, w), np.float32) for w in config.widths]
    for step in range(config.steps):
        acts[0] = x[step % config.batches]
        for layer in layers:
            forward(acts[layer.index - 1], layer.weight(params), layer.bias(params),
                    acts[layer.index], layer.index < config.layers)
        loss(acts[-1], y[step % config.batches], deltas[-1], losses[step:step + 1])
        for layer in reversed(layers):
            i = layer.index
            backward(acts[i - 1], deltas[i], layer.weight(params), layer.weight(grads),
                     layer.bias(grads), deltas[i - 1] if i > 1 else None)
        sgd(params, grads, config.lr)
    return params, losses


def check(results: Sequence[RankResult], config: Config, rtol: float, atol: float) -> str:
    """Raise AssertionError unless every rank has the same weights, bit for bit, and
    they match the single-process run; return a one-line summary."""
    first = results[0].params
    for result in results[1:]:
        if not np.array_equal(result.params, first):
            raise AssertionError(f"rank {result.rank}'s weights differ from rank 0's in "
                                 f"{np.count_nonzero(result.params != first)} places")
    expected, expected_losses = reference(config, len(results))
    np.testing.assert_allclose(first, expected, rtol=rtol, atol=atol,
                               err_msg="the weights differ from the single-process run's")
    np.testing.assert_allclose(mean_loss(results), expected_losses, rtol=rtol, atol=atol,
                               err_msg="the losses differ from the single-process run's")
    worst = float(np.max(np.abs(first - expected)))
    return (f"every rank's weights are identical (bitwise) and within rtol {rtol:g}, atol "
            f"{atol:g} of a single-process full-batch run (largest difference {worst:.1e})")


def mean_loss(results: Sequence[RankResult]) -> np.ndarray:
    """The global batch's loss at each step: the mean of the ranks' (equal shards)."""
    return np.mean([r.losses for r in results], axis=0, dtype=np.float64).astype(np.float32)


# -- reporting --------------------------------------------------------------------------------

def step_times(results: Sequence[RankResult], mode: str) -> list[float]:
    """Seconds of each timed step of `mode`, of the slowest rank."""
    return [max(per_rank) for per_rank in zip(*(r.times[mode] for r in results))]


def cores_busy(results: Sequence[RankResult], mode: str) -> float:
    """The median over `mode`'s timed steps of the CPU time all processes spent
    during the step over its wall time (of each process, its first rank measures)."""
    first = {r.pid: r for r in sorted(results, key=lambda r: -r.rank)}.values()
    cpu = [sum(per_process) for per_process in zip(*(r.cpu[mode] for r in first))]
    return statistics.median(c / t for c, t in zip(cpu, step_times(results, mode)))


def summary(values: Sequence[float]) -> tuple[float, float, float, float]:
    """(median, first quartile, third quartile, minimum)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0], ordered[0], ordered[0], ordered[0]
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return statistics.median(ordered), q1, q3, ordered[0]


def describe(config: Config, nranks: int, where: str) -> list[str]:
    layers = layout(config.widths)
    nparams = sum(layer.size for layer in layers)
    mib = 4 / 2**20
    groups = ", ".join(f"[{' '.join(map(str, b.layers))}] {(b.stop - b.start) * mib:.2f} MiB"
                       for b in buckets(layers, config.bucket_size))
    return [f"data-parallel SGD on {nranks} ranks ({where}), {os.cpu_count()} cores",
            (f"model {'-'.join(map(str, config.widths))}: {nparams:,} parameters, "
             f"{nparams * mib:.2f} MiB of gradients per step; batch {config.batch} per rank "
             f"({nranks * config.batch} global), lr {config.lr:g}"),
            f"buckets (layers, from the last; cap {config.bucket_size / 2**20:g} MiB): {groups}"]


def report(results: Sequence[RankResult], config: Config, modes: Sequence[str]) -> list[str]:
    lines = ["step  loss"]
    losses = mean_loss(results)
    shown = sorted({0, *range(0, config.steps, max(1, config.steps // 8)), config.steps - 1})
    lines += [f"{k:4d}  {losses[k]:.4f}" for k in shown]
    timed = {mode: [t * 1e3 for t in step_times(results, mode)] for mode in modes}  # ms
    if all(timed.values()):
        counts = sorted({len(t) for t in timed.values()})
        lines.append(f"step time after {config.warmup} warm-up steps of each mode, slowest rank, "
                     f"over {'/'.join(map(str, counts))} steps: median [quartiles] minimum; "
                     f"cores busy (median)")
        for mode in modes:
            median, q1, q3, low = summary(timed[mode])
            lines.append(f"  {mode:<10}  {median:7.2f} ms  [{q1:.2f}-{q3:.2f}]  {low:.2f}  "
                         f"{cores_busy(results, mode):.1f} cores")
        if len(modes) == 2:
            gain = 1 - summary(timed[OVERLAP])[0] / summary(timed[SEQUENTIAL])[0]
            lines.append(f"  overlap saves {100 * gain:.0f}% of the median step")
            # steps 2i and 2i+1 ran back to back: their ratio shrugs off the machine's
            # slower and faster spells, which hit both alike
            ratios = [o / s for o, s in zip(timed[OVERLAP], timed[SEQUENTIAL])]
            median, q1, q3, _ = summary(ratios)
            lines.append(f"  overlapped / sequential step, pair by pair: median {median:.2f} "
                         f"[{q1:.2f}-{q3:.2f}]")
    else:
        lines.append(f"(no step timed: --steps must exceed {config.warmup * len(modes)})")
    return lines


def plot_losses(results: Sequence[RankResult], config: Config, path: str) -> None:
    """The loss curve, with the single-process run's drawn over it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, expected = reference(config, len(results))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(mean_loss(results), label=f"{len(results)} ranks, allreduce per bucket", lw=2.5)
    ax.plot(expected, "--", label="one process, whole batch", color="black", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean squared error)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{'-'.join(map(str, config.widths))} MLP, global batch "
                 f"{len(results) * config.batch}, lr {config.lr:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_trace(results: Sequence[RankResult], steps: int, path: str) -> None:
    """Every rank's calls during the last `steps` steps, as one trace file: from the
    first rank's start of the first to each rank's end of the last. (Processes on one
    machine share perf_counter's clock: under `aaccl launch` their ranks line up.)"""
    start = min(r.windows[-steps][0] for r in results)
    trace = aaccl.Trace()
    trace.origin = start
    for result in results:
        end = result.windows[-1][1]
        for engine, name, begin, finish, args in result.spans:
            if finish > start and begin < end:
                trace.add(result.rank, engine, name, max(begin, start), min(finish, end),
                          **args)
    trace.save(path)


# -- the command line ------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    try:
        if text[-1:].lower() in units:
            return int(float(text[:-1]) * units[text[-1].lower()])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, K/M/G suffix)") from None


def parser() -> argparse.ArgumentParser:
    defaults = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4,
                   help="ranks in this process (default 4); under aaccl launch: one per process")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--warmup", type=int, default=defaults.warmup,
                   help="steps of each mode left out of the timing")
    p.add_argument("--batch", type=int, default=defaults.batch, help="samples per rank per step")
    p.add_argument("--widths", default="-".join(map(str, defaults.widths)),
                   help="layer widths, input to output (default %(default)s)")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--bucket-size", type=parse_size, default=defaults.bucket_size,
                   help="bytes of gradients per allreduce, K/M suffixes (default 1M; 0: one "
                        "bucket per layer)")
    p.add_argument("--seed", type=int, default=defaults.seed)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-overlap", action="store_true", help="the sequential baseline only")
    mode.add_argument("--overlap-only", action="store_true", help="no sequential steps")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare the weights across ranks and with one process (default on)")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    p.add_argument("--plot", metavar="PNG", help="draw the loss curve (needs matplotlib)")
    p.add_argument("--trace", metavar="JSON",
                   help="record every rank's calls in the last steps (one of each mode)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        widths = tuple(int(w) for w in args.widths.split("-"))
    except ValueError:
        p.error(f"--widths: not a list of widths: {args.widths}")
    if len(widths) < 2 or min(widths) < 1 or min(args.ranks, args.steps, args.batch) < 1 \
            or args.warmup < 0:
        p.error("widths, ranks, steps and batch are positive; warmup is not negative")
    config = Config(widths, args.batch, args.steps, args.lr, args.bucket_size,
                    warmup=args.warmup, seed=args.seed)
    modes = ((SEQUENTIAL,) if args.no_overlap else (OVERLAP,) if args.overlap_only
             else (OVERLAP, SEQUENTIAL))
    launched = aaccl.mpi_launched()
    mine: list[int] = []  # the ranks this process runs

    trace = None

    async def rank(accl: aaccl.ACCL) -> RankResult:
        mine.append(accl.rank)
        return await train(accl, config, modes, trace)

    options = {"backend": args.backend, "world_size": None if launched else args.ranks}
    if args.trace:
        with aaccl.tracing() as trace:
            results = aaccl.run(rank, **options)
    else:
        results = aaccl.run(rank, **options)
    if 0 not in mine:  # under launch every process has every result: rank 0 reports
        return 0
    traced = min(len(modes), config.steps)
    if args.trace:
        save_trace(results, traced, args.trace)
    where = "one per process" if launched else f"in process, {args.backend}"
    print("\n".join(describe(config, len(results), f"{where}, soft CCLO")))
    print("\n".join(report(results, config, modes)))
    if args.trace:
        print(f"trace of the last {traced} step{'s' * (traced > 1)}, every rank: {args.trace}; "
              f"draw it with "
              f"aaccl trace plot {args.trace} -o timeline.png")
    if args.plot:
        plot_losses(results, config, args.plot)
        print(f"loss curve: {args.plot}")
    if args.check:
        try:
            print("check:", check(results, config, args.rtol, args.atol), ": ok")
        except AssertionError as exc:
            print(f"check FAILED: {exc}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
