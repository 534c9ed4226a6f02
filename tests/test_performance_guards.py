"""Untimed guards of the performance properties: no retracing, memory."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accum_model import AccumulatingModel
from helpers import mlp
from helpers import regression_data
from helpers import traced_step


class TraceCounting(AccumulatingModel):
    """Counts how often `train_step` is traced (Python runs only then)."""

    traces = 0

    def train_step(self, data):
        TraceCounting.traces += 1
        return super().train_step(data)


def test_training_function_is_not_retraced_after_the_first_epoch():
    # 100 samples in micro-batches of 8: the last, short micro-batch has
    # another shape, which Keras handles with one relaxed trace.
    x, y = regression_data(samples=100)
    model = mlp(TraceCounting, n_gradients=4)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after_first_epoch = TraceCounting.traces
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              validation_data=(x[:16], y[:16]))
    assert 1 <= after_first_epoch <= 2
    assert TraceCounting.traces == after_first_epoch


def _traces_of_first_fit(model_class, build, x, y, **kwargs):
    """How often the first fit() traces the loss (once per trace of the
    step; `fit()` also calls a loss of one's own eagerly, to try it)."""
    traces = []

    def counting_loss(y_true, y_pred):
        if not tf.executing_eagerly():
            traces.append(1)
        return keras.losses.mean_squared_error(y_true, y_pred)

    model = build(model_class, **kwargs)
    model.compile(optimizer="adam", loss=counting_loss)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return len(traces)


def _bn_mlp(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(hidden))
    return model_class(inputs, keras.layers.Dense(3)(hidden), **kwargs)


@pytest.mark.filterwarnings("ignore:BatchNormalization layers")
@pytest.mark.parametrize("build", [mlp, _bn_mlp])
def test_the_first_fit_traces_the_step_once(build):
    # The window's variables exist before the step is traced: a first trace
    # that created them would make TensorFlow trace the step twice. (Plain
    # Keras's count includes its symbolic build's call of the loss.)
    x, y = regression_data(samples=96)
    assert _traces_of_first_fit(AccumulatingModel, build, x, y,
                                n_gradients=4) == 1


def _dense_stack(model_class, depth, normalized, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = inputs
    for _ in range(depth):
        hidden = keras.layers.Dense(8)(hidden)
        if normalized:
            hidden = keras.layers.BatchNormalization()(hidden)
    return model_class(inputs, keras.layers.Dense(3)(hidden), **kwargs)


def _window_nodes(depth, normalized):
    """Nodes the accumulating step's graph has beyond plain Keras's."""
    x, y = regression_data(samples=32)
    nodes = []
    for model_class, kwargs in ((keras.Model, {}),
                                (AccumulatingModel, {"n_gradients": 4})):
        model = _dense_stack(model_class, depth, normalized, **kwargs)
        model.compile(optimizer="sgd", loss="mse")
        graph = traced_step(model, tf.distribute.get_strategy(), x, y)
        nodes.append(len(graph.node) + sum(
            len(function.node_def) for function in graph.library.function))
    return nodes[1] - nodes[0]


@pytest.mark.filterwarnings("ignore:BatchNormalization layers")
def test_pooled_statistics_trace_few_operations_per_normalization_layer():
    # What a first fit() traces and optimises grows with the graph: the
    # window pools every layer's statistics with one set of operations, so
    # a layer adds little beyond its two weights' accumulation.
    per_dense_block = (_window_nodes(8, False) - _window_nodes(2, False)) / 6
    per_normalized_block = (
        _window_nodes(8, True) - _window_nodes(2, True)) / 6
    per_weight = per_dense_block / 2
    pooling_per_layer = per_normalized_block - 4 * per_weight
    assert per_weight > 0
    assert pooling_per_layer <= 10


def test_accumulators_hold_one_float32_copy_of_the_trainable_parameters(
    two_replicas,
):
    x, y = regression_data(samples=32)
    keras.mixed_precision.set_global_policy("mixed_float16")
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=2)
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    parameters = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert model.accumulator_bytes == 4 * parameters
    window = model._accumulation.window
    for accumulator, variable in zip(window.gradient_sums,
                                     model.trainable_weights):
        assert accumulator.dtype == tf.float32
        assert tuple(accumulator.shape) == tuple(variable.shape)
        # One copy per replica, each of the variable's size.
        copies = two_replicas.experimental_local_results(accumulator)
        assert len(copies) == 2
        assert all(tuple(c.shape) == tuple(variable.shape) for c in copies)
