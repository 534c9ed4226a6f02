"""What crosses replicas: nothing per micro step, one gradient reduction per
window (counted in the traced training step, as `fit()` runs it)."""

import keras
import pytest
import tensorflow as tf

from accum_model import AccumulatingModel
from helpers import iterations
from helpers import mlp
from helpers import regression_data


def _traced_step(model, strategy, x, y):
    """The GraphDef of one training step, as `fit()` would run it."""
    model.make_train_function()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    element = next(iter(strategy.experimental_distribute_dataset(dataset)))
    step = tf.function(lambda data: strategy.run(model.train_step, (data,)))
    return step.get_concrete_function(element).graph.as_graph_def()


def _collective_reductions(graph_def, num_replicas):
    """Counts reductions run on every step and those under a condition.

    Each replica runs its own collective op for one reduction, so ops are
    divided by the number of replicas.
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    counts = {"every_step": 0, "conditional": 0}

    def visit(nodes, conditional):
        for node in nodes:
            if node.op.startswith(("Collective", "Nccl")):
                counts["conditional" if conditional else "every_step"] += 1
            for key in ("then_branch", "else_branch", "f", "body", "cond"):
                if key in node.attr and node.attr[key].func.name:
                    visit(library[node.attr[key].func.name].node_def,
                          conditional or key.endswith("_branch"))

    visit(graph_def.node, False)
    return {k: v / num_replicas for k, v in counts.items()}


@pytest.mark.parametrize("clipping", [False, True])
def test_one_gradient_reduction_per_window(two_replicas, clipping):
    x, y = regression_data(samples=64)

    def optimizer():
        return keras.optimizers.SGD(0.1, clipnorm=1.0 if clipping else None)

    with two_replicas.scope():
        plain = mlp(keras.Model)
        plain.compile(optimizer=optimizer(), loss="mse")
        accumulating = mlp(AccumulatingModel, n_gradients=4)
        accumulating.compile(optimizer=optimizer(), loss="mse")
    plain_counts = _collective_reductions(
        _traced_step(plain, two_replicas, x, y), 2
    )
    our_counts = _collective_reductions(
        _traced_step(accumulating, two_replicas, x, y), 2
    )
    # Plain Keras reduces the gradients on every micro step.
    assert plain_counts == {"every_step": 1, "conditional": 0}
    # Accumulation: nothing per micro step; at the window end the window's
    # weight and finiteness (one small reduction), then the gradients once
    # (twice with clipping, which needs the summed gradient first).
    assert our_counts == {"every_step": 0,
                          "conditional": 3 if clipping else 2}

    # The conditional branch runs once per window: 8 micro-batches, 2
    # windows, so 2 * our_counts reductions against 8 for plain Keras.
    accumulating.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    windows = iterations(accumulating)
    assert windows == 2
    assert windows * our_counts["conditional"] < (
        iterations(plain) * plain_counts["every_step"]
    )


def test_windows_carried_over_epochs_count_micro_steps_with_one_scalar(
        two_replicas):
    # With flush_each_epoch=False an empty step at the end of the data would
    # shift every later window; telling it apart takes one scalar reduction
    # per micro step (the batch sizes), and nothing else per micro step.
    x, y = regression_data(samples=64)
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4, flush_each_epoch=False)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    counts = _collective_reductions(_traced_step(model, two_replicas, x, y), 2)
    assert counts == {"every_step": 1, "conditional": 2}


def test_batch_statistics_ride_in_the_window_reduction(two_replicas):
    # A training BatchNormalization adds its pooled statistics to the
    # window's one small reduction: still nothing per micro step, and as
    # many reductions per window as without it.
    x, y = regression_data(samples=64)

    def build():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8)(inputs)
        hidden = keras.layers.BatchNormalization()(hidden)
        return AccumulatingModel(inputs, keras.layers.Dense(3)(hidden),
                                 n_gradients=4)

    with two_replicas.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    counts = _collective_reductions(_traced_step(model, two_replicas, x, y),
                                    2)
    assert counts == {"every_step": 0, "conditional": 2}


def test_noise_scale_rides_in_the_window_reduction(two_replicas):
    # Measuring the noise scale adds three scalars per replica to the
    # window's one small reduction, and no reduction anywhere.
    x, y = regression_data(samples=64)
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4,
                    measure_noise_scale=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    counts = _collective_reductions(_traced_step(model, two_replicas, x, y),
                                    2)
    assert counts == {"every_step": 0, "conditional": 2}
