"""Cases trained by two MultiWorkerMirroredStrategy worker processes.

`tests/test_multi_worker.py` starts this script twice (one process per
worker, on 127.0.0.1) and compares what each case saved with one device.
Every case trains its own model under the one strategy of the process, in
global micro-batches of 8 (4 per worker) and windows of 4.

Run by the tests: python tests/multi_worker_cases.py --worker-index I \
    --ports P0 P1 --out DIR
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from helpers import batch_norm_mlp  # noqa: E402
from helpers import BatchMeanLoss  # noqa: E402
from helpers import collective_reductions  # noqa: E402
from helpers import mlp  # noqa: E402
from helpers import regression_data  # noqa: E402
from helpers import scalar_output_mlp  # noqa: E402
from helpers import traced_step  # noqa: E402

MICRO_BATCH = 8
N_GRADIENTS = 4
EPOCHS = 2


def linear_model(model_class, **kwargs):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((6,))
    return model_class(inputs, keras.layers.Dense(3)(inputs), **kwargs)


def one_output_mlp(model_class, **kwargs):
    return mlp(model_class, outputs=1, **kwargs)


# name -> (builder, loss, learning rate, samples, outputs, data source)
CASES = {
    # Keras divides a reduced loss by the replicas, but not a scalar one.
    "scalar_output": (scalar_output_mlp, "mse", 0.1, 96, 1, "arrays"),
    "batch_mean_loss": (one_output_mlp, BatchMeanLoss, 0.1, 96, 1,
                        "arrays"),
    # Each worker reads its half of every micro-batch from the function;
    # at the end of the data a step runs on no data.
    "datasets_from_function": (mlp, "mse", 0.1, 80, 3, "function"),
    # Learning rate 0: the moving statistics of the windows are exactly
    # the large batch's (the forward pass is the same every epoch).
    "batch_statistics": (batch_norm_mlp, "mse", 0.0, 96, 3, "arrays"),
    # Under mixed_float16: loss scaling, and the finiteness verdict of
    # both workers in the window's reduction.
    "mixed_precision": (mlp, "mse", 0.1, 96, 3, "arrays"),
    # Learning rate 0 and known halves: the noise scale is computable.
    "noise_scale": (linear_model, "mse", 0.0, 80, 3, "function"),
}


def case_data(name):
    _, _, _, samples, outputs, _ = CASES[name]
    x, y = regression_data(samples=samples, outputs=outputs)
    if name == "scalar_output":
        y = y[:, 0]
    return x, y


def worker_rows(samples, worker):
    """The rows worker `worker` reads, in order, from the function's data:
    its half of each global micro-batch."""
    half = MICRO_BATCH // 2
    return np.concatenate([
        np.arange(start + worker * half, start + (worker + 1) * half)
        for start in range(0, samples, MICRO_BATCH)
    ])


def make_loss(name):
    loss = CASES[name][1]
    return loss() if isinstance(loss, type) else loss


def policy(name):
    return "mixed_float16" if name == "mixed_precision" else "float32"


def train_case(name, strategy, worker):
    keras.mixed_precision.set_global_policy(policy(name))
    try:
        return _train_case(name, strategy)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _train_case(name, strategy):
    build, _, learning_rate, samples, _, source = CASES[name]
    x, y = case_data(name)
    with strategy.scope():
        extra = {"measure_noise_scale": True} if name == "noise_scale" else {}
        model = build(AccumulatingModel, n_gradients=N_GRADIENTS, **extra)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                      loss=make_loss(name))
    if source == "arrays":
        history = model.fit(x, y, batch_size=MICRO_BATCH, epochs=EPOCHS,
                            shuffle=False, verbose=0)
    else:
        def dataset_fn(context):
            rows = worker_rows(samples, context.input_pipeline_id)
            return tf.data.Dataset.from_tensor_slices(
                (x[rows], y[rows])
            ).batch(context.get_per_replica_batch_size(MICRO_BATCH))

        data = strategy.distribute_datasets_from_function(dataset_fn)
        history = model.fit(data, epochs=EPOCHS, verbose=0)
    return model, {
        "iterations": int(model.optimizer.iterations.numpy()),
        "replicas": strategy.num_replicas_in_sync,
        "history": {k: [float(v) for v in values]
                    for k, values in history.history.items()},
    }


def count_collectives(strategy):
    """The reductions in this worker's traced training step, with clipping
    (each worker process runs one collective op per reduction)."""
    x, y = regression_data(samples=64)
    with strategy.scope():
        model = mlp(AccumulatingModel, n_gradients=N_GRADIENTS)
        model.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=1.0),
                      loss="mse")
    return collective_reductions(traced_step(model, strategy, x, y), 1)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker-index", type=int, required=True)
    parser.add_argument("--ports", type=int, nargs=2, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports]},
        "task": {"type": "worker", "index": args.worker_index},
    })
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    for name in CASES:
        model, report = train_case(name, strategy, args.worker_index)
        prefix = os.path.join(args.out, f"{name}_worker{args.worker_index}")
        np.savez(prefix + ".npz", *model.get_weights())
        with open(prefix + ".json", "w") as f:
            json.dump(report, f)
    counts = count_collectives(strategy)
    with open(os.path.join(args.out, f"collectives_worker"
                           f"{args.worker_index}.json"), "w") as f:
        json.dump(counts, f)


if __name__ == "__main__":
    main()
