"""Two workers, one link: what reducing once per window saves.

Two `MultiWorkerMirroredStrategy` workers (or, with `--backend jax`, two JAX
processes under `keras.distribution.DataParallel`) on 127.0.0.1, one CPU
core each, train a model whose gradient is 16.8 MB (a 2048x2048 dense layer
and a small head). For each link bandwidth, the workers time plain Keras at
micro-batch b against `AccumulatingModel` with n = 1, 2, 4, 8, 16 at the
same b, in interleaved rounds (the order rotates every round), and count the
cross-worker reductions in each model's traced training step (on JAX, the
elements all-reduced in its compiled step).

A bandwidth other than "host" is made with `tc` (token bucket) on the
loopback of a network namespace the benchmark creates and removes itself;
the workers run inside it, so no other traffic is shaped. Without `ip
netns` / `tc` (not root, or no kernel support) those rows are skipped and
the reason printed.

From the times it fits, per bandwidth, time per micro-batch = compute +
reduce / n, and reports the n from which reducing costs under 5% of a
micro-batch.

Each point's residual from the fitted line is reported, and the speed-up
per sample over plain Keras.

`--package-path DIR` runs the workers on the accum_model found in DIR (a
checkout of another commit, e.g. made with `git worktree add`), so that two
versions can be compared on the same machine; `--name` keeps its results
apart.

Run: sudo python benchmarks/multi_worker_bandwidth.py [--backend jax]
         [--bandwidths host 10gbit 1gbit 100mbit] [--rounds 7]
         [--out benchmarks/results] [--package-path DIR --name NAME]
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

N_VALUES = (1, 2, 4, 8, 16)
MICRO_BATCHES = 16  # per timed fit(): whole windows for every n above
WIDTH = 2048
LOCAL_MICRO_BATCH = 16  # per worker; the global micro-batch is twice that
from harness import ROOT
from harness import collective_reductions
from harness import commit
from harness import free_ports
from harness import jax_all_reduces
from harness import jax_distributed_step_text
from harness import machine
from harness import plain_keras_class
from harness import run_bounded
from harness import traced_step
from harness import write_json


# One worker -------------------------------------------------------------------


def _build(keras, model_class, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    hidden = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(hidden)
    model = model_class(inputs=inputs, outputs=outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _models(keras, plain_class):
    """Plain Keras and an accumulating model per n."""
    from accum_model import AccumulatingModel

    models = {"keras": _build(keras, plain_class)}
    for n in N_VALUES:
        # n_gradients=1 as an int would run Keras's own step; {0: 1}
        # runs the accumulating step with windows of one micro-batch.
        models[f"n={n}"] = _build(keras, AccumulatingModel,
                                  n_gradients=n if n > 1 else {0: 1})
    return models


def run_worker(args):
    if args.backend == "jax":
        return run_jax_process(args)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports]},
        "task": {"type": "worker", "index": args.worker_index},
    })
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        models = _models(keras, plain_keras_class())

    global_batch = 2 * LOCAL_MICRO_BATCH
    rng = np.random.default_rng(0)
    x = rng.normal(size=(MICRO_BATCHES * global_batch, WIDTH)).astype(
        "float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    reductions = {
        name: _reductions_per_step(model, strategy, x, y)
        for name, model in models.items()
    }
    _time_and_report(args, models, x, y, global_batch, reductions)


def run_jax_process(args):
    """One of two JAX processes under `keras.distribution.DataParallel`,
    each feeding its own half of every micro-batch."""
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    import numpy as np

    keras.distribution.initialize(f"127.0.0.1:{args.ports[0]}", 2,
                                  args.worker_index)
    distribution = keras.distribution.DataParallel(
        devices=jax.devices(), auto_shard_dataset=False)
    keras.distribution.set_distribution(distribution)
    models = _models(keras, keras.Model)
    rng = np.random.default_rng(args.worker_index)
    x = rng.normal(size=(MICRO_BATCHES * LOCAL_MICRO_BATCH, WIDTH)).astype(
        "float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    # Elements all-reduced in the compiled step (tests/test_communication.py
    # counts with the same functions); the fit it runs first traces.
    reductions = {
        name: jax_all_reduces(jax_distributed_step_text(
            model, distribution, x, y, batch_size=LOCAL_MICRO_BATCH))
        for name, model in models.items()
    }
    _time_and_report(args, models, x, y, LOCAL_MICRO_BATCH, reductions)


def _time_and_report(args, models, x, y, batch_size, reductions):
    """Times one epoch of each model in rotating rounds; the first worker
    writes the times and the reductions."""

    def timed_fit(model):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                  verbose=0)
        return (time.perf_counter() - start) / MICRO_BATCHES

    for model in models.values():
        timed_fit(model)  # traces; not timed
    names = list(models)
    times = {name: [] for name in names}
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[
            :round_index % len(names)]
        for name in order:
            times[name].append(timed_fit(models[name]))
    if args.worker_index == 0:
        with open(os.path.join(args.out, "worker0.json"), "w") as f:
            json.dump({"seconds_per_micro_batch": times,
                       "reductions": reductions,
                       "gradient_bytes": 4 * models["keras"].count_params()},
                      f)


def _reductions_per_step(model, strategy, x, y):
    """Collective reductions in one traced training step of `model`.

    "every_step" run on each micro-batch; "conditional" only when the step
    ends a window. tests/test_communication.py counts with the same
    functions.
    """
    local_replicas = len(strategy.extended.worker_devices)
    return collective_reductions(traced_step(model, strategy, x, y),
                                 local_replicas)


# Network namespaces -----------------------------------------------------------


class ShapedLoopback:
    """A network namespace whose loopback runs at `rate` (tc rate string).

    Created on entry, removed on exit, whatever happens in between.
    """

    def __init__(self, rate):
        self.rate = rate
        self.name = f"accum_bench_{os.getpid()}"

    def __enter__(self):
        _run(["ip", "netns", "add", self.name])
        try:
            self.exec(["ip", "link", "set", "lo", "up"])
            bits = _bits_per_second(self.rate)
            # The bucket must hold at least one loopback packet (64 KiB)
            # and a timer tick's worth of traffic.
            burst = max(256 * 1024, int(bits / 8 / 100))
            self.exec(["tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                       "rate", self.rate, "burst", str(burst),
                       "latency", "200ms"])
        except Exception:
            self.__exit__()
            raise
        return self

    def exec(self, command):
        _run(["ip", "netns", "exec", self.name] + command)

    def prefix(self):
        return ["ip", "netns", "exec", self.name]

    def __exit__(self, *exc):
        subprocess.run(["ip", "netns", "del", self.name],
                       capture_output=True)


def _run(command):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise OSError(f"{' '.join(command)}: {result.stderr.strip()}")


def _bits_per_second(rate):
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * factor
    raise ValueError(f"Unknown rate {rate!r}: use e.g. 10gbit, 100mbit")


# The launcher -----------------------------------------------------------------


def run_pair(args, prefix, timeout):
    """Runs both workers (under `prefix`); returns worker 0's report."""
    out = tempfile.mkdtemp(prefix="accum_bench_")
    # A fresh namespace has every port free; on the host pick free ones.
    ports = [23456, 23457] if prefix else free_ports(2)
    commands = [
        prefix + ([] if args.no_pin else [
            "taskset", "-c", str(index % os.cpu_count())]) + [sys.executable,
            os.path.abspath(__file__), "--worker-index", str(index),
            "--ports", *map(str, ports), "--rounds", str(args.rounds),
            "--out", out, "--backend", args.backend,
        ]
        for index in range(2)
    ]
    if args.package_path:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(args.package_path)]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
               if p])
    results = run_bounded(commands, timeout)
    if any(code for code, _ in results):
        raise RuntimeError("a worker failed:\n" + "\n".join(
            output[-2000:] for _, output in results))
    with open(os.path.join(out, "worker0.json")) as f:
        return json.load(f)


def summarize(report):
    """Medians with spread, and the fit time = compute + reduce / n."""
    times = report["seconds_per_micro_batch"]
    rows = {name: {"median_ms": 1e3 * statistics.median(t),
                   "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t)}
            for name, t in times.items()}
    ns = [n for n in N_VALUES]
    medians = [rows[f"n={n}"]["median_ms"] for n in ns]
    # Least squares on [1, 1/n].
    a11 = len(ns)
    a12 = sum(1 / n for n in ns)
    a22 = sum(1 / n ** 2 for n in ns)
    b1 = sum(medians)
    b2 = sum(m / n for m, n in zip(medians, ns))
    det = a11 * a22 - a12 ** 2
    compute = (a22 * b1 - a12 * b2) / det
    reduce = (a11 * b2 - a12 * b1) / det
    for n in ns:
        row = rows[f"n={n}"]
        fitted = compute + reduce / n
        row["residual_pct"] = 100 * (row["median_ms"] - fitted) / fitted
        row["speedup_vs_keras"] = rows["keras"]["median_ms"] / row[
            "median_ms"]
    # The smallest n at which reducing costs under 5% of the compute.
    negligible = (max(1, int(-(-reduce // (0.05 * compute))))
                  if reduce > 0 and compute > 0 else 1)
    return {"rows": rows, "fit_compute_ms": compute,
            "fit_reduce_ms": reduce, "n_where_reduce_under_5pct": negligible,
            "reductions": report["reductions"],
            "gradient_bytes": report["gradient_bytes"]}


def _links(results):
    """The per-link results (the "_run" entry describes the run)."""
    return {k: v for k, v in results.items() if not k.startswith("_")}


def to_markdown(results):
    run = results.get("_run", {})
    lines = [
        "# Two workers: time per micro-batch by link bandwidth",
        "",
        f"Command: `{run.get('command', 'not recorded')}`",
        f"Machine: {run.get('machine', 'not recorded')}",
        f"Date: {run.get('date', 'not recorded')}",
        f"accum_model: {run.get('accum_model', 'not recorded')}",
        "",
        "Milliseconds per micro-batch (global micro-batch of 32 over two "
        f"{WORKERS[run.get('backend', 'tensorflow')]} on 127.0.0.1, a "
        "2048-2048-10 "
        "MLP with a 16.8 MB gradient, SGD), median [min, max] over the "
        "rounds. \"keras\" is plain Keras on every micro-batch; n=k is "
        "AccumulatingModel with n_gradients=k. The fit is the least-squares "
        "line time = compute + reduce/n over the n columns.",
        "",
        "| link | keras (ms) | " + " | ".join(f"n={n} (ms)" for n in N_VALUES)
        + " | fit: compute + reduce/n (ms) | n for reduce < 5% |",
        "|---|---|" + "---|" * len(N_VALUES) + "---|---|",
    ]
    for link, summary in _links(results).items():
        if "skipped" in summary:
            lines.append(f"| {link} | skipped: {summary['skipped']} |")
            continue
        rows = summary["rows"]

        def cell(name):
            r = rows[name]
            return (f"{r['median_ms']:.1f} [{r['min_ms']:.1f}, "
                    f"{r['max_ms']:.1f}]")

        lines.append(
            f"| {link} | {cell('keras')} | "
            + " | ".join(cell(f"n={n}") for n in N_VALUES)
            + f" | {summary['fit_compute_ms']:.1f} + "
            f"{summary['fit_reduce_ms']:.1f}/n | "
            f"{summary['n_where_reduce_under_5pct']} |"
        )
    lines += [
        "",
        "Residual of each median from the fitted line (median / fit - 1), "
        "and speed-up per sample over plain Keras (Keras's median / the "
        "column's).",
        "",
        "| link | " + " | ".join(f"n={n}" for n in N_VALUES) + " |",
        "|---|" + "---|" * len(N_VALUES),
    ]
    for link, summary in _links(results).items():
        if "skipped" in summary:
            continue
        rows = summary["rows"]
        lines.append(f"| {link} | " + " | ".join(
            f"{rows[f'n={n}']['residual_pct']:+.0f}%, "
            f"{rows[f'n={n}']['speedup_vs_keras']:.2f}x"
            for n in N_VALUES) + " |")
    reductions = next((s["reductions"] for s in _links(results).values()
                       if "reductions" in s), None)
    if reductions:
        lines += ["", (
            "Elements all-reduced in one compiled training step"
            if run.get("backend") == "jax" else
            "Collective reductions in one traced training step") + ": "
                  + json.dumps(reductions)]
    return "\n".join(lines)


WORKERS = {
    "tensorflow": "MultiWorkerMirroredStrategy workers",
    "jax": "JAX processes under keras.distribution.DataParallel (one CPU "
           "device each)",
}
LINK_NAMES = {"host": "loopback, no limit", "10gbit": "10 Gbit/s link",
              "1gbit": "1 Gbit/s link", "100mbit": "100 Mbit/s link"}


def plot(results, path):
    """One panel per link: AccumulatingModel's time per micro-batch against
    n (median, bars from the fastest to the slowest round), and plain
    Keras's as a band over the same range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = [(link, summary) for link, summary in _links(results).items()
             if "skipped" not in summary]
    figure, axes = plt.subplots(1, len(links), figsize=(4 * len(links), 4.2),
                                sharey=True, squeeze=False)
    for axis, (link, summary) in zip(axes[0], links):
        keras_row = summary["rows"]["keras"]
        axis.axhspan(keras_row["min_ms"], keras_row["max_ms"], color="0.85",
                     label="plain Keras, fastest to slowest round")
        axis.axhline(keras_row["median_ms"], color="0.3", linestyle="--",
                     label="plain Keras, median")
        rows = [summary["rows"][f"n={n}"] for n in N_VALUES]
        medians = [row["median_ms"] for row in rows]
        axis.errorbar(
            N_VALUES, medians,
            yerr=[[m - row["min_ms"] for m, row in zip(medians, rows)],
                  [row["max_ms"] - m for m, row in zip(medians, rows)]],
            fmt="o-", color="C0", capsize=3,
            label="AccumulatingModel, median and range")
        axis.set_xscale("log", base=2)
        axis.set_xticks(N_VALUES, [str(n) for n in N_VALUES])
        axis.set_yscale("log")
        ticks = [25, 50, 100, 200, 400, 800, 1600, 3200]
        axis.set_yticks(ticks, [str(t) for t in ticks])
        axis.minorticks_off()
        axis.set_title(LINK_NAMES.get(link, link))
        axis.set_xlabel("n_gradients")
    axes[0][0].set_ylabel("ms per micro-batch (lower is faster)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=10, loc="lower center", ncol=3,
                  frameon=False)
    figure.suptitle("Two workers, 16.8 MB gradient: a window of n reduces "
                    "once, plain Keras every micro-batch")
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", nargs="+",
                        default=["host", "10gbit", "1gbit", "100mbit"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("tensorflow", "jax"),
                        default="tensorflow",
                        help="MultiWorkerMirroredStrategy workers, or JAX "
                             "processes under keras.distribution")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--no-pin", action="store_true",
                        help="let the scheduler place the workers instead "
                             "of one core each (taskset)")
    parser.add_argument("--package-path",
                        help="directory whose accum_model the workers use")
    parser.add_argument("--name",
                        help="file name stem of the results (default "
                             "multi_worker_bandwidth, or "
                             "jax_processes_bandwidth with --backend jax)")
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--replot", action="store_true",
                        help="rewrite the .md and .png from the .json, "
                             "without measuring")
    args = parser.parse_args(argv)
    if args.name is None:
        args.name = ("jax_processes_bandwidth" if args.backend == "jax"
                     else "multi_worker_bandwidth")
    if args.backend == "jax":
        # The run's record names the backend the workers train on.
        os.environ["KERAS_BACKEND"] = "jax"
    if args.replot:
        with open(os.path.join(args.out, args.name + ".json")) as f:
            results = json.load(f)
        write_results(results, args.out, args.name)
        return 0
    if args.worker_index is not None:
        run_worker(args)
        return 0

    for link in args.bandwidths:
        if link != "host":
            try:
                _bits_per_second(link)
            except ValueError as error:
                parser.error(f"--bandwidths: {error}")
    results = {}
    for link in args.bandwidths:
        start = time.monotonic()
        if link == "host":
            report = run_pair(args, [], args.timeout)
        else:
            try:
                shaped = ShapedLoopback(link)
                shaped.__enter__()
            except OSError as error:
                results[link] = {"skipped": str(error)}
                print(f"{link}: skipped ({error})")
                continue
            try:
                report = run_pair(args, shaped.prefix(), args.timeout)
            finally:
                shaped.__exit__()
        results[link] = summarize(report)
        print(f"{link}: done in {time.monotonic() - start:.0f} s")
    results["_run"] = {
        "command": "python " + " ".join(
            [os.path.relpath(__file__)] + sys.argv[1:]),
        "machine": machine("shared by the workers" if args.no_pin
                           else "one per worker"),
        "date": datetime.date.today().isoformat(),
        "accum_model": commit(args.package_path or ROOT),
        "backend": args.backend,
    }
    first = next((s for s in _links(results).values()
                  if "reductions" in s), None)
    if first:
        print("reductions in one step:", json.dumps(first["reductions"]))
    write_results(results, args.out, args.name)
    return 0


def write_results(results, out, name="multi_worker_bandwidth"):
    markdown = to_markdown(results)
    print(markdown)
    write_json(os.path.join(out, name + ".json"), results)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(markdown + "\n")
    plot(results, os.path.join(out, name + ".png"))


if __name__ == "__main__":
    sys.exit(main())
