"""What the multi-process examples share: the data, the model, the launcher
of their processes on 127.0.0.1, and plain Keras's large batch in one
process to compare them with.

Used by `multi_worker.py` (TensorFlow) and `jax_processes.py` (JAX); needs
only Keras and NumPy, on whichever backend the example runs.
"""

import json
import os
import socket
import subprocess
import tempfile
import time

import keras
import numpy as np


def make_data(samples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 10)).astype("float32")
    w = rng.normal(size=(10, 3)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(samples, 3))).astype(
        "float32"
    )
    return x, y


def build_model(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((10,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def make_optimizer():
    return keras.optimizers.Adam(0.01)


class DieAtEpoch(keras.callbacks.Callback):
    """Kills this process in the middle of an epoch: a worker failure."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch
        self.current = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == 2:
            os._exit(3)


def free_ports(count):
    """`count` TCP ports free on 127.0.0.1 now."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_bounded(commands, timeout, stop_all_on_failure=False):
    """Runs `commands` at once; returns their (exit code, output) in order.

    Never leaves a process behind: on timeout (or any error while waiting)
    all are killed and reaped, and the error is raised. With
    `stop_all_on_failure`, once one exits with an error the others are
    killed too, as a cluster manager stops a job whose process died.
    """
    processes = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        for command in commands
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        if stop_all_on_failure:
            while any(p.poll() is None for p in processes):
                if any(p.poll() for p in processes):
                    for process in processes:
                        if process.poll() is None:
                            process.kill()
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(commands, timeout)
                time.sleep(0.2)
        for process in processes:
            remaining = max(1.0, deadline - time.monotonic())
            output, _ = process.communicate(timeout=remaining)
            results.append((process.returncode, output))
    except BaseException:
        for process in processes:
            if process.poll() is None:
                process.kill()
        for process in processes:
            process.communicate()
        raise
    return results


def single_process_reference(args, policy=None):
    """Plain Keras, one device, one step on each window's samples.

    Windows are `n_gradients` micro-batches of `micro_batch` samples, each
    epoch's last one shorter; with `--carry-window` they run on across epoch
    ends (the last of training is applied when it ends).
    """
    keras.mixed_precision.set_global_policy(
        policy or ("mixed_float16" if args.mixed_precision else "float32")
    )
    model = build_model(keras.Model)
    model.compile(optimizer=make_optimizer(), loss="mse")
    x, y = make_data(args.samples)
    if not args.carry_window:
        model.fit(x, y, batch_size=args.micro_batch * args.n_gradients,
                  epochs=args.epochs, shuffle=False, verbose=0)
        return model
    micro_batches = [
        np.arange(start, min(start + args.micro_batch, args.samples))
        for _ in range(args.epochs)
        for start in range(0, args.samples, args.micro_batch)
    ]
    for first in range(0, len(micro_batches), args.n_gradients):
        rows = np.concatenate(micro_batches[first:first + args.n_gradients])
        model.train_on_batch(x[rows], y[rows])
    return model


def max_difference(first, second):
    """The largest absolute difference between two lists of weights."""
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


def saved_weights(path):
    """The weights a process saved with `np.savez(path, *weights)`."""
    with np.load(path) as arrays:
        return [arrays[k] for k in sorted(
            arrays.files, key=lambda name: int(name.split("_")[1]))]


def add_arguments(parser):
    """The arguments both multi-process examples take."""
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="global micro-batch size (over both processes)")
    parser.add_argument("--n-gradients", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--carry-window", action="store_true",
                        help="flush_each_epoch=False: windows span epochs")
    parser.add_argument("--backup-dir")
    parser.add_argument("--fail-at-epoch", type=int)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out")
    parser.add_argument("--json", action="store_true",
                        help="print the comparison as one JSON line")


def forwarded(args, out):
    """What a launcher passes each process of `add_arguments`' arguments."""
    command = ["--out", out, "--samples", str(args.samples),
               "--micro-batch", str(args.micro_batch), "--n-gradients",
               str(args.n_gradients), "--epochs", str(args.epochs)]
    if args.carry_window:
        command.append("--carry-window")
    if args.backup_dir:
        command += ["--backup-dir", args.backup_dir]
    if args.fail_at_epoch is not None:
        command += ["--fail-at-epoch", str(args.fail_at_epoch)]
    return command


def launch_and_compare(args, launch, compare, name, summary):
    """The launcher's side of a multi-process example: runs `launch(args,
    out, timeout)`, then prints `compare(args, out)` (as one JSON line with
    `--json`, else `summary` of it), or each failed process's output,
    naming it `name` and its index. Returns the exit code."""
    out = args.out or tempfile.mkdtemp(prefix="accum_model_processes_")
    start = time.monotonic()
    results = launch(args, out, args.timeout)
    seconds = time.monotonic() - start
    codes = [code for code, _ in results]
    if any(codes):
        if args.json:
            print(json.dumps({"exit_codes": codes, "seconds": seconds,
                              "outputs": [o[-3000:] for _, o in results]}))
        for index, (code, output) in enumerate(results):
            if code != 0:
                print(f"{name} {index} exited with {code}:\n"
                      f"{output[-3000:]}")
        return 1
    comparison = compare(args, out)
    if args.json:
        print(json.dumps({"exit_codes": codes, "seconds": seconds,
                          **comparison}))
    else:
        print(summary(comparison))
    return 0
