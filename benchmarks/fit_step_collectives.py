"""Collectives in the whole step `fit()` runs under two workers.

`tests/test_communication.py` counts the collective reductions in the
traced `train_step`. Under `MultiWorkerMirroredStrategy`, Keras's `fit()`
wraps that step in a function of its own, which also reduces across
workers: the distributed iterator agrees on the end of the data, and Keras
averages every log (`reduce_per_replica`). This script starts two workers on
127.0.0.1 and counts the collectives in that whole per-step function
(Keras's `multi_step_on_iterator`) for plain Keras and `AccumulatingModel`
(n_gradients=4), with the loss alone and with the loss and one metric:
those on every step, and those under a condition (a window's end).

Run: python benchmarks/fit_step_collectives.py
"""

import json
import os
import sys

from harness import collective_reductions
from harness import free_ports
from harness import plain_keras_class
from harness import run_bounded


def run_worker(index, ports):
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    from accum_model import AccumulatingModel

    PlainKeras = plain_keras_class()

    def mlp(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        return model_class(inputs, keras.layers.Dense(3)(hidden), **kwargs)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    counts = {}
    for name, model_class, keywords in (
        ("plain Keras", PlainKeras, {}),
        ("AccumulatingModel", AccumulatingModel, {"n_gradients": 4}),
    ):
        for metrics in ([], ["mae"]):
            with strategy.scope():
                model = mlp(model_class, **keywords)
                model.compile(optimizer=keras.optimizers.SGD(0.1),
                              loss="mse", metrics=metrics)
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            step = _keras_step_function(model.train_function)
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
            iterator = iter(strategy.experimental_distribute_dataset(dataset))
            graph = step.get_concrete_function(iterator).graph.as_graph_def()
            label = f"{name}, loss{' + mae' if metrics else ''}"
            counts[label] = collective_reductions(graph, 1)
    if index == 0:
        print(json.dumps(counts))


def _keras_step_function(train_function):
    """Keras's traced per-step function, found in the closures of the
    `train_function` that `fit()` calls (an accumulating model wraps it)."""
    import tensorflow as tf

    seen, pending = set(), [train_function]
    while pending:
        candidate = pending.pop()
        if id(candidate) in seen:
            continue
        seen.add(id(candidate))
        if isinstance(candidate, tf.types.experimental.PolymorphicFunction):
            if "iterator" in candidate.__name__:
                return candidate
            continue
        for cell in getattr(candidate, "__closure__", None) or ():
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    raise RuntimeError("Keras's per-step function was not found")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        run_worker(int(sys.argv[2]), json.loads(sys.argv[3]))
        return
    ports = free_ports(2)
    results = run_bounded([
        [sys.executable, os.path.abspath(__file__), "--worker", str(index),
         json.dumps(ports)]
        for index in range(2)
    ], timeout=600)
    code, output = results[0]
    lines = [line for line in output.splitlines() if line.startswith("{")]
    if code or not lines:
        sys.exit(output[-3000:])
    print("Collective reductions per step of fit() under two workers "
          "(every step / under a condition):")
    for label, count in json.loads(lines[-1]).items():
        print(f"  {label}: {count['every_step']:.0f} / "
              f"{count['conditional']:.0f}")


if __name__ == "__main__":
    main()
