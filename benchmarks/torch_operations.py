"""What a micro step costs on PyTorch: operations dispatched and time.

Counts the aten operations each `train_on_batch` dispatches (a
`TorchDispatchMode` that sees every call that reaches a kernel; a
`torch._foreach_*` call over a list counts once), averaged over a window of
8 micro steps, for plain Keras at the micro-batch and for an
`AccumulatingModel` with `n_gradients=8`, on a 20-layer MLP and on
ResNet-50 at 32x32 (BatchNormalization pooled over the window). On a GPU
each operation is at least one kernel launch plus Python, so the count is
the CPU's proxy for the GPU's time. Then times both models' micro-batches
on the MLP in paired rounds (median of the per-round ratios).

Run: KERAS_BACKEND=torch python benchmarks/torch_operations.py
         [--rounds 5] [--out DIR]
"""

import argparse
import collections
import datetime
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from harness import machine  # noqa: E402
from harness import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOW = 8


class _OperationCount(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _mlp(accumulating):
    inputs = keras.Input((64,))
    hidden = inputs
    for _ in range(20):
        hidden = keras.layers.Dense(64, activation="relu")(hidden)
    outputs = keras.layers.Dense(1)(hidden)
    if accumulating:
        return AccumulatingModel(inputs, outputs, n_gradients=WINDOW)
    return keras.Model(inputs, outputs)


def _resnet(accumulating):
    backbone = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10)
    if accumulating:
        return AccumulatingModel(backbone.inputs, backbone.outputs,
                                 n_gradients=WINDOW)
    return backbone


MODELS = {
    "mlp": (_mlp, lambda n: (np.random.rand(n, 64), np.random.rand(n, 1)),
            "mse", 32),
    "resnet50_32x32": (
        _resnet, lambda n: (np.random.rand(n, 32, 32, 3),
                            np.random.randint(0, 10, (n,))),
        "sparse_categorical_crossentropy", 8),
}


def _compiled(name, accumulating):
    build, _, loss, _ = MODELS[name]
    keras.utils.set_random_seed(0)
    model = build(accumulating)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    return model


def _batches(name, count):
    _, data, _, batch = MODELS[name]
    x, y = data(batch * count)
    x = x.astype("float32")
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])
            for i in range(count)]


def count_operations(name):
    """Operations per micro step, averaged over one window, by model."""
    batches = _batches(name, 2 * WINDOW)
    counts = {}
    for label, accumulating in (("plain", False), ("accumulating", True)):
        model = _compiled(name, accumulating)
        for x, y in batches[:WINDOW]:  # Builds and warms up.
            model.train_on_batch(x, y)
        counter = _OperationCount()
        with counter:
            for x, y in batches[WINDOW:]:
                model.train_on_batch(x, y)
        counts[label] = sum(counter.counts.values()) / WINDOW
    counts["ratio"] = counts["accumulating"] / counts["plain"]
    return counts


def time_micro_batches(name, rounds):
    """Seconds per micro-batch of each model, and the median ratio."""
    batches = _batches(name, WINDOW)
    models = {label: _compiled(name, accumulating)
              for label, accumulating in (("plain", False),
                                          ("accumulating", True))}
    for model in models.values():
        for x, y in batches:
            model.train_on_batch(x, y)
    times = {label: [] for label in models}
    for _ in range(rounds):
        for label, model in models.items():
            start = time.perf_counter()
            for _ in range(4):
                for x, y in batches:
                    model.train_on_batch(x, y)
            times[label].append((time.perf_counter() - start)
                                / (4 * WINDOW))
    ratios = [a / p for a, p in zip(times["accumulating"], times["plain"])]
    return {"plain_s": statistics.median(times["plain"]),
            "accumulating_s": statistics.median(times["accumulating"]),
            "ratio": statistics.median(ratios)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # As run_benchmarks.py times PyTorch.
    print(machine())
    results = {"machine": machine(), "window": WINDOW, "operations": {}}
    print(f"aten operations per micro step, window of {WINDOW}")
    for name in MODELS:
        counts = count_operations(name)
        results["operations"][name] = counts
        print(f"  {name:16s} plain {counts['plain']:8.1f}  accumulating "
              f"{counts['accumulating']:8.1f}  ratio {counts['ratio']:.3f}")
    timing = time_micro_batches("mlp", args.rounds)
    results["mlp_time"] = timing
    print(f"mlp time per micro-batch: plain {timing['plain_s'] * 1e3:.2f} ms,"
          f" accumulating {timing['accumulating_s'] * 1e3:.2f} ms, median "
          f"paired ratio {timing['ratio']:.3f} ({args.rounds} rounds)")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    write_json(os.path.join(args.out, f"torch_operations-{stamp}.json"),
               results)


if __name__ == "__main__":
    main()
