"""Two-process DataParallel training on JAX on localhost.

Launches two processes (each its own Python process with one CPU device,
`keras.distribution.initialize` pointing both at a free 127.0.0.1 port)
that train one `AccumulatingModel` under `keras.distribution.DataParallel`
over both processes' devices, each feeding its own half of every
micro-batch; then trains the same model as a plain `keras.Model` in this
process, on one device, with the large batch, from the same initial
weights, and prints how far apart they are.

Run: python examples/jax_processes.py
     python examples/jax_processes.py --carry-window --backup-dir /tmp/b \
         --fail-at-epoch 1   # then again without --fail-at-epoch: resumes
"""

import argparse
import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from processes import DieAtEpoch  # noqa: E402
from processes import add_arguments  # noqa: E402
from processes import build_model  # noqa: E402
from processes import forwarded  # noqa: E402
from processes import free_ports  # noqa: E402
from processes import launch_and_compare  # noqa: E402
from processes import make_data  # noqa: E402
from processes import make_optimizer  # noqa: E402
from processes import max_difference  # noqa: E402
from processes import run_bounded  # noqa: E402
from processes import saved_weights  # noqa: E402
from processes import single_process_reference  # noqa: E402

PROCESSES = 2


def own_rows(samples, micro_batch, process, processes=PROCESSES):
    """The rows process `process` feeds: its part of every micro-batch of
    `micro_batch` samples (the last one shorter), in order."""
    parts = []
    for start in range(0, samples, micro_batch):
        size = min(micro_batch, samples - start) // processes
        parts.append(np.arange(start + process * size,
                               start + (process + 1) * size))
    return np.concatenate(parts)


def run_process(args):
    """Trains as process `args.process_index`; writes its final weights."""
    keras.distribution.initialize(f"127.0.0.1:{args.port}", PROCESSES,
                                  args.process_index)
    # Each process hands fit() its own rows (see `own_rows`).
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=jax.devices(), auto_shard_dataset=False))
    model = build_model(AccumulatingModel, n_gradients=args.n_gradients,
                        flush_each_epoch=not args.carry_window)
    model.compile(optimizer=make_optimizer(), loss="mse")
    callbacks = []
    if args.backup_dir:
        # Each process keeps its own backup: their weights are identical.
        callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(
            args.backup_dir, f"process{args.process_index}")))
    if args.fail_at_epoch is not None and args.process_index == 1:
        callbacks.append(DieAtEpoch(args.fail_at_epoch))
    x, y = make_data(args.samples)
    rows = own_rows(args.samples, args.micro_batch, args.process_index)
    model.fit(x[rows], y[rows], batch_size=args.micro_batch // PROCESSES,
              epochs=args.epochs, shuffle=False, verbose=0,
              callbacks=callbacks)
    prefix = os.path.join(args.out, f"process{args.process_index}")
    np.savez(prefix + ".npz", *model.get_weights())
    with open(prefix + ".json", "w") as f:
        json.dump({"iterations": int(model.optimizer.iterations.value),
                   "devices": len(jax.devices()),
                   "processes": jax.process_count()}, f)


def launch_processes(args, out, timeout):
    """Starts both processes; returns their exit codes and outputs. One
    that dies takes the other down with it, as a cluster manager would
    (JAX's own check notices a dead peer only after 100 seconds)."""
    port, = free_ports(1)
    commands = []
    for index in range(PROCESSES):
        commands.append([
            sys.executable, os.path.abspath(__file__), "--process-index",
            str(index), "--port", str(port), *forwarded(args, out)])
    return run_bounded(commands, timeout, stop_all_on_failure=True)


def compare(args, out):
    processes = [saved_weights(os.path.join(out, f"process{index}.npz"))
                 for index in range(PROCESSES)]
    reference = single_process_reference(args).get_weights()
    with open(os.path.join(out, "process0.json")) as f:
        info = json.load(f)
    return {
        "processes_max_difference": max_difference(*processes),
        "vs_single_process_max_difference": max_difference(processes[0],
                                                           reference),
        **info,
    }


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--process-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    last = args.samples % args.micro_batch
    if args.micro_batch % PROCESSES or last % PROCESSES:
        parser.error(
            f"--micro-batch and the last micro-batch ({last} samples of "
            f"--samples) must split evenly over the {PROCESSES} processes, "
            f"as DataParallel splits every batch. Received: --micro-batch "
            f"{args.micro_batch}, --samples {args.samples}")
    args.mixed_precision = False
    return args


def main(argv=None):
    args = parse(argv)
    if args.process_index is not None:
        run_process(args)
        return 0
    return launch_and_compare(args, launch_processes, compare, "process",
                              summary)


def summary(comparison):
    return "\n".join([
        f"{comparison['devices']} devices in {comparison['processes']} "
        f"processes, {comparison['iterations']} updates",
        "max |weight difference| between the processes: "
        f"{comparison['processes_max_difference']:.2e}",
        "max |weight difference| vs one process, large batch: "
        f"{comparison['vs_single_process_max_difference']:.2e}"])


if __name__ == "__main__":
    sys.exit(main())
