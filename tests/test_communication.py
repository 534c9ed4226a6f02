"""What crosses devices, counted in the training step as `fit()` runs it.

TensorFlow (MirroredStrategy): nothing per micro step, one reduction per
window. JAX (`keras.distribution.DataParallel`): the micro step reduces the
loss only and the window end the gradient, once; where the samples meet in
the micro step (pooled moments, the noise scale, float16 sums) the micro
step reduces the gradient as plain Keras's step does, and the window end
adds nothing.
"""

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import _chooser
from backends import jax_only
from backends import keras_2_too
from backends import tensorflow_only
from helpers import LossScaleOptimizer
from helpers import batch_norm_mlp
from helpers import collective_reductions
from helpers import compiled_jax_step
from helpers import iterations
from helpers import jax_all_reduces
from helpers import keras
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data
from helpers import traced_step
from helpers import weights_file

pytestmark = keras_2_too

ONE_PER_WINDOW = {"every_step": 0, "conditional": 1}

tensorflow_graph = tensorflow_only("counted in TensorFlow's traced graph")


# name -> (model builder, optimizer keywords, model keywords)
CONFIGURATIONS = {
    "plain": (mlp, {}, {}),
    "clipnorm": (mlp, {"clipnorm": 1.0}, {}),
    "global_clipnorm": (mlp, {"global_clipnorm": 1.0}, {}),
    "clipvalue": (mlp, {"clipvalue": 0.1}, {}),
    "batch_statistics": (batch_norm_mlp, {}, {}),
    "noise_scale": (mlp, {}, {"measure_noise_scale": True}),
    "float16_accumulators": (mlp, {}, {"accumulator_dtype": "float16"}),
    "float64_accumulators": (mlp, {}, {"accumulator_dtype": "float64"}),
}


def _compiled(strategy, build, optimizer_keywords, model_keywords,
              model_class=AccumulatingModel, **extra):
    with strategy.scope():
        model = build(model_class, n_gradients=4, **model_keywords, **extra)
        model.compile(optimizer=keras.optimizers.SGD(0.1,
                                                     **optimizer_keywords),
                      loss="mse")
    return model


@tensorflow_graph
@pytest.mark.filterwarnings("ignore:BatchNormalization layers")
@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_one_reduction_per_window(two_replicas, name):
    build, optimizer_keywords, model_keywords = CONFIGURATIONS[name]
    x, y = regression_data(samples=64)
    model = _compiled(two_replicas, build, optimizer_keywords,
                      model_keywords)
    counts = collective_reductions(traced_step(model, two_replicas, x, y), 2)
    # The window's totals and its gradient sums travel together; clipping
    # acts on the reduced gradient, so it needs no reduction of its own.
    assert counts == ONE_PER_WINDOW


@tensorflow_graph
def test_one_reduction_per_window_under_loss_scaling(two_replicas):
    # The finiteness verdict of every replica rides in the same reduction.
    x, y = regression_data(samples=64)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _compiled(two_replicas, mlp, {}, {})
        assert isinstance(model.optimizer, LossScaleOptimizer)
        counts = collective_reductions(
            traced_step(model, two_replicas, x, y), 2)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert counts == ONE_PER_WINDOW


@tensorflow_graph
def test_plain_keras_reduces_on_every_micro_step_and_windows_once(
        two_replicas):
    x, y = regression_data(samples=64)
    with two_replicas.scope():
        plain = mlp(keras.Model)
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model = _compiled(two_replicas, mlp, {}, {})
    assert collective_reductions(traced_step(plain, two_replicas, x, y),
                                 2) == {"every_step": 1, "conditional": 0}
    # The conditional branch runs once per window: 8 micro-batches, 2
    # windows, 2 reductions against plain Keras's 8.
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert iterations(model) == 2


@tensorflow_graph
def test_a_window_ended_early_or_restored_reduces_once(two_replicas,
                                                       tmp_path):
    # A window that ends before it is full (the end of an epoch or of
    # training applies it) runs the same window end from its own function;
    # a window restored from a checkpoint carries on in the training step.
    x, y = regression_data(samples=40)
    model = _compiled(two_replicas, mlp, {"clipnorm": 1.0}, {},
                      flush_each_epoch=False)
    model.train_on_batch(x[:8], y[:8])
    assert model._accumulation.open_micro_steps() == 1
    apply_open = model._accumulation.window_end._make_apply_open()
    graph = apply_open.get_concrete_function().graph.as_graph_def()
    assert collective_reductions(graph, 2) == ONE_PER_WINDOW
    path = weights_file(tmp_path, "open")
    model.save_weights(path)
    restored = _compiled(two_replicas, mlp, {"clipnorm": 1.0}, {},
                         flush_each_epoch=False)
    restored.train_on_batch(x[:8], y[:8])
    restored.load_weights(path)
    assert restored._accumulation.open_micro_steps() == 1
    counts = collective_reductions(
        traced_step(restored, two_replicas, x, y), 2)
    # One scalar per micro step tells empty steps apart (see below).
    assert counts == {"every_step": 1, "conditional": 1}


@tensorflow_graph
def test_without_the_optimizer_hook_two_reductions_stay_exact(
        two_replicas, monkeypatch):
    # Where the optimizer cannot be kept from summing over replicas, the
    # first replica hands in the reduced gradient and the others zeros:
    # the optimizer's own sum is a second reduction, and clipping still
    # acts on the whole gradient.
    monkeypatch.setattr(_chooser.adapter.LossScaling,
                        "applies_summed_gradients", False)
    x, y = regression_data(samples=96)
    model = _compiled(two_replicas, mlp, {"clipnorm": 0.05}, {})
    assert collective_reductions(traced_step(model, two_replicas, x, y),
                                 2) == {"every_step": 0, "conditional": 2}
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=0.05),
                  loss="mse")
    plain.set_weights(model.get_weights())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert iterations(model) == 6
    assert max_weight_difference(plain, model) <= 1e-5
    assert np.all(np.isfinite(model.get_weights()[0]))


@tensorflow_graph
def test_windows_carried_over_epochs_count_micro_steps_with_one_scalar(
        two_replicas):
    # With flush_each_epoch=False an empty step at the end of the data would
    # shift every later window; telling it apart takes one scalar reduction
    # per micro step (the batch sizes), and nothing else per micro step.
    x, y = regression_data(samples=64)
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4, flush_each_epoch=False)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    counts = collective_reductions(traced_step(model, two_replicas, x, y), 2)
    assert counts == {"every_step": 1, "conditional": 1}


# Where each device's share of a micro-batch's gradient can be summed apart
# from the others'; in the rest the samples meet in the micro step.
SUMMED_APART = ("plain", "clipnorm", "global_clipnorm", "clipvalue",
                "batch_statistics", "dropout", "activity_regularizer")


def _mlp_with(layer):
    def build(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = layer()(keras.layers.Dense(8, activation="tanh")(inputs))
        return model_class(inputs=inputs,
                           outputs=keras.layers.Dense(3)(hidden), **kwargs)
    return build


def _activity_regularized_mlp(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh",
                                activity_regularizer="l2")(inputs)
    return model_class(inputs=inputs, outputs=keras.layers.Dense(3)(hidden),
                       **kwargs)


# The layers that keep the gradient apart on JAX, besides the configurations.
DATA_PARALLEL_CONFIGURATIONS = {
    **CONFIGURATIONS,
    "dropout": (_mlp_with(lambda: keras.layers.Dropout(0.25)), {}, {}),
    "activity_regularizer": (_activity_regularized_mlp, {}, {}),
}


@jax_only("keras.distribution.DataParallel")
@pytest.mark.filterwarnings("ignore:BatchNormalization layers")
@pytest.mark.parametrize("name", sorted(DATA_PARALLEL_CONFIGURATIONS))
def test_data_parallel_reduces_the_gradient_once_per_window(two_replicas,
                                                            name):
    if name == "float64_accumulators":
        pytest.skip("float64 on JAX needs jax_enable_x64, refused otherwise "
                    "(tests/test_backends.py)")
    build, optimizer_keywords, model_keywords = (
        DATA_PARALLEL_CONFIGURATIONS[name])
    x, y = regression_data(samples=64)
    with two_replicas.scope():
        plain = build(keras.Model)
        plain.compile(optimizer=keras.optimizers.SGD(0.1,
                                                     **optimizer_keywords),
                      loss="mse")
    model = _compiled(two_replicas, build, optimizer_keywords,
                      model_keywords)
    plain_elements = jax_all_reduces(compiled_jax_step(plain, two_replicas,
                                                       x, y))
    elements = jax_all_reduces(compiled_jax_step(model, two_replicas, x, y))
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # Plain Keras reduces the gradient (and the loss) on every step.
    assert plain_elements["every_step"] > weights
    assert plain_elements["conditional"] == 0
    if name in SUMMED_APART:
        # The micro step reduces what plain Keras's does but the gradient:
        # the loss, a BatchNormalization layer's moments, and the two
        # numbers of a random layer's seed (taken from the first device);
        # the window end the gradient.
        seed = 2 if name == "dropout" else 0
        assert elements == {
            "every_step": plain_elements["every_step"] - weights + seed,
            "conditional": weights}
    else:
        assert elements == {"every_step": plain_elements["every_step"],
                            "conditional": 0}


class _FixedNoise(keras.layers.Layer):
    def call(self, inputs):
        return inputs + keras.random.normal(keras.ops.shape(inputs), seed=3)


class _LargestActivation(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(keras.ops.max(inputs))
        return inputs


@jax_only("keras.distribution.DataParallel")
@pytest.mark.parametrize("build", [_mlp_with(_LargestActivation),
                                   _mlp_with(_FixedNoise)],
                         ids=["added_loss", "fixed_seed"])
def test_data_parallel_passes_where_samples_meet_reduce_each_micro_step(
        two_replicas, build):
    # A loss a layer adds in its call (known only as a number, here the
    # largest activation, which each device's share cannot give), or a
    # draw from a fixed seed (the same numbers on every device's share), is
    # known only as the step is traced: the window's sums are already one
    # block per device, so the micro step reduces as plain Keras's and the
    # window end sums the blocks.
    x, y = regression_data(samples=64)
    with two_replicas.scope():
        plain = build(keras.Model)
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model = _compiled(two_replicas, build, {}, {})
    plain_elements = jax_all_reduces(compiled_jax_step(plain, two_replicas,
                                                       x, y))
    elements = jax_all_reduces(compiled_jax_step(model, two_replicas, x, y))
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert elements == {"every_step": plain_elements["every_step"],
                        "conditional": weights}
