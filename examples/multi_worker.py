"""Two-worker MultiWorkerMirroredStrategy training on localhost.

Launches two worker processes (each its own Python process, `TF_CONFIG`
pointing at two free 127.0.0.1 ports) that train one `AccumulatingModel`
with `tf.distribute.MultiWorkerMirroredStrategy`, then trains the same model
as a plain `keras.Model` in this process, on one device, with the large
batch, from the same initial weights, and prints how far apart they are.

Run: python examples/multi_worker.py
     python examples/multi_worker.py --mixed-precision --samples 200
     python examples/multi_worker.py --carry-window --backup-dir /tmp/b \
         --fail-at-epoch 1   # then again without --fail-at-epoch: resumes
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

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


# One worker ------------------------------------------------------------------


def run_worker(args):
    """Trains as worker `args.worker_index`; writes its final weights."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports]},
        "task": {"type": "worker", "index": args.worker_index},
    })
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        if args.plain_keras:
            model = build_model(keras.Model)
        else:
            model = build_model(AccumulatingModel,
                                n_gradients=args.n_gradients,
                                flush_each_epoch=not args.carry_window)
        model.compile(optimizer=make_optimizer(), loss="mse")

    callbacks = []
    if args.backup_dir:
        # Each worker keeps its own backup: their weights are identical.
        callbacks.append(keras.callbacks.BackupAndRestore(
            os.path.join(args.backup_dir, f"worker{args.worker_index}")
        ))
    if args.fail_at_epoch is not None and args.worker_index == 1:
        callbacks.append(DieAtEpoch(args.fail_at_epoch))

    x, y = make_data(args.samples)
    model.fit(x, y, batch_size=args.micro_batch, epochs=args.epochs,
              shuffle=False, verbose=0, callbacks=callbacks)
    np.savez(
        os.path.join(args.out, f"worker{args.worker_index}.npz"),
        *model.get_weights(),
    )
    with open(os.path.join(args.out, f"worker{args.worker_index}.json"),
              "w") as f:
        json.dump({
            "iterations": int(model.optimizer.iterations.numpy()),
            "replicas": strategy.num_replicas_in_sync,
        }, f)


# The launcher ----------------------------------------------------------------


def launch_workers(args, out, timeout):
    """Starts both workers; returns their exit codes and outputs."""
    ports = free_ports(2)
    commands = []
    for index in range(2):
        command = [
            sys.executable, os.path.abspath(__file__), "--worker-index",
            str(index), "--ports", *map(str, ports), *forwarded(args, out),
        ]
        if args.mixed_precision:
            command.append("--mixed-precision")
        if args.plain_keras:
            command.append("--plain-keras")
        commands.append(command)
    return run_bounded(commands, timeout)


def compare(args, out):
    workers = [saved_weights(os.path.join(out, f"worker{index}.npz"))
               for index in range(2)]
    reference = single_process_reference(args).get_weights()

    with open(os.path.join(out, "worker0.json")) as f:
        info = json.load(f)
    comparison = {
        "workers_max_difference": max_difference(workers[0], workers[1]),
        "vs_single_process_max_difference": max_difference(workers[0],
                                                       reference),
        "iterations": info["iterations"],
        "replicas": info["replicas"],
    }
    if args.mixed_precision:
        # How far float16 rounding alone moves the large batch: the scale
        # against which the mixed-precision difference is to be read.
        float32_reference = single_process_reference(args, "float32")
        comparison["float16_rounding_max_difference"] = max_difference(
            reference, float32_reference.get_weights()
        )
    return comparison


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--plain-keras", action="store_true",
                        help="train keras.Model in the workers instead")
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", type=int, nargs=2, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.worker_index is not None:
        run_worker(args)
        return 0
    return launch_and_compare(args, launch_workers, compare, "worker",
                              summary)


def summary(comparison):
    return "\n".join([
        f"{comparison['replicas']} replicas on 2 worker processes, "
        f"{comparison['iterations']} updates",
        "max |weight difference| between the workers: "
        f"{comparison['workers_max_difference']:.2e}",
        "max |weight difference| vs one process, large batch: "
        f"{comparison['vs_single_process_max_difference']:.2e}"])


if __name__ == "__main__":
    sys.exit(main())
