"""Mixed precision: loss scaled per micro-batch, overflow skips the window."""

import contextlib
import math
import warnings

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model._chooser import adapter
from backends import ON_KERAS_2
from backends import ON_TENSORFLOW
from backends import jax_only
from backends import keras_2_too
from backends import keras_3_only
from helpers import LossScaleOptimizer
from helpers import counted_steps
from helpers import fit_both
from helpers import iterations
from helpers import keras
from helpers import loss_scale
from helpers import max_weight_difference
from helpers import mean_of_squares
from helpers import mlp
from helpers import numpy_of
from helpers import regression_data

if ON_TENSORFLOW:
    import tensorflow as tf

pytestmark = keras_2_too

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


def _explicit_loss_scaling(make_optimizer):
    return lambda: LossScaleOptimizer(make_optimizer(),
                                      initial_scale=2.0**12)


def _fit_under(policy, make_optimizer, x, y, strategy=None, epochs=2):
    keras.mixed_precision.set_global_policy(policy)
    try:
        return fit_both(mlp, make_optimizer, x, y, micro_batch=8,
                        n_gradients=4, epochs=epochs, strategy=strategy)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _float32_large_batch(make_optimizer, x, y, epochs=2):
    model = mlp(keras.Model)
    model.compile(optimizer=make_optimizer(), loss="mse")
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False,
                        verbose=0)
    return model, history


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("loss_scaling", ["implicit", "explicit"])
def test_mixed_float16_matches_mixed_large_batch(name, loss_scaling):
    x, y = regression_data(samples=96)
    make_optimizer = OPTIMIZERS[name]
    if loss_scaling == "explicit":
        make_optimizer = _explicit_loss_scaling(make_optimizer)
    plain, accumulating = _fit_under("mixed_float16", make_optimizer, x, y)
    assert isinstance(accumulating.optimizer,
                      LossScaleOptimizer)
    assert iterations(accumulating) == iterations(plain) == 6
    # float16 rounds the large batch's own gradient: how far that run is
    # from float32 sets the scale of "equal up to float16 rounding". A
    # gradient scaled twice, or not unscaled, misses it by orders.
    float32_model, _ = _float32_large_batch(OPTIMIZERS[name], x, y)
    rounding = max_weight_difference(plain, float32_model)
    assert max_weight_difference(plain, accumulating) <= 2 * rounding + 1e-6


def test_reported_loss_is_unscaled():
    x, y = regression_data(samples=96)
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0)
    keras.mixed_precision.set_global_policy("float32")
    reference = mlp(AccumulatingModel, n_gradients=4)
    reference.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    float32_history = reference.fit(x, y, batch_size=8, epochs=2,
                                    shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"],
                               float32_history.history["loss"], rtol=0.03)
    assert history.history["skipped_windows"] == [0, 0]


def _data_with_overflow_in_second_window():
    x, y = regression_data(samples=64)
    y = y.copy()
    # Sample 41 is in micro-batch 6, the second window. Its error, times
    # the loss scale, overflows float16 in the backward pass.
    y[41] = 1e4
    return x, y


def test_overflow_skips_the_whole_window():
    x, y = _data_with_overflow_in_second_window()
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    first_window_only = mlp(AccumulatingModel, n_gradients=4)
    first_window_only.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    initial_scale = 2.0**15
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                        verbose=0)
    first_window_only.fit(x[:32], y[:32], batch_size=8, epochs=1,
                          shuffle=False, verbose=0)

    assert iterations(model) == counted_steps(2, 1)
    assert model.skipped_windows == 1
    assert history.history["skipped_windows"] == [1]
    assert loss_scale(model.optimizer) == initial_scale / 2
    assert max_weight_difference(model, first_window_only) == 0.0

    clean_x, clean_y = regression_data(samples=64)
    model.fit(clean_x, clean_y, batch_size=8, epochs=1, shuffle=False,
              verbose=0)
    assert iterations(model) == counted_steps(4, 1)
    assert model.skipped_windows == 1
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


@pytest.mark.parametrize("verbose", [1, 2])
def test_the_progress_bar_shows_skipped_windows_as_a_whole_number(verbose,
                                                                  capsys):
    x, y = _data_with_overflow_in_second_window()
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                        verbose=verbose)
    shown = capsys.readouterr().out
    assert history.history["skipped_windows"] == [1]
    # The count as it stands, never an average over the epoch's steps;
    # Progbars before keras 3.11, and Keras 2's, format every value as a
    # float.
    import inspect

    if "stateless_metrics" in inspect.signature(
            keras.utils.Progbar).parameters:
        assert "skipped_windows: 1\n" in shown + "\n"
        assert "skipped_windows: 1.0" not in shown
    else:
        assert "skipped_windows: 1.0000" in shown


def test_scale_grows_with_updates_not_micro_batches():
    x, y = regression_data(samples=128)
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(
        optimizer=LossScaleOptimizer(
            OPTIMIZERS["sgd"](), initial_scale=2.0**8,
            dynamic_growth_steps=2,
        ),
        loss="mse",
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    # 16 micro-batches, 4 updates: the scale doubles after updates 2 and 4.
    assert iterations(model) == 4
    assert loss_scale(model.optimizer) == 2.0**10


def test_mixed_bfloat16_matches_bfloat16_large_batch():
    x, y = regression_data(samples=96)
    plain, accumulating = _fit_under("mixed_bfloat16", OPTIMIZERS["sgd"],
                                     x, y)
    assert not isinstance(accumulating.optimizer,
                          LossScaleOptimizer)
    float32_model, _ = _float32_large_batch(OPTIMIZERS["sgd"], x, y)
    rounding = max_weight_difference(plain, float32_model)
    assert iterations(accumulating) == 6
    assert max_weight_difference(plain, accumulating) <= 2 * rounding + 1e-6


class _MeanPenalty(keras.layers.Layer):
    def call(self, inputs):
        # In float32, as Keras adds losses (on TensorFlow it cannot add a
        # 16-bit term to its float32 loss).
        self.add_loss(0.1 * mean_of_squares(
            keras.ops.cast(inputs, "float32")))
        return inputs


@keras_3_only("keras.ops in the layer")
def test_the_first_fit_of_a_process_under_mixed_bfloat16_trains_quietly():
    # What fit() measures of this Keras once a process (an activity
    # penalty's divisor) and the layers it tries (a mean added with
    # `add_loss`) are read in float32: TensorFlow converts no bfloat16
    # tensor to NumPy.
    measured_once = getattr(adapter.losses.activity_penalty_is_a_mean,
                            "cache_clear", None)
    if measured_once is not None:
        measured_once()
    x, y = regression_data(samples=32)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        inputs = keras.Input((6,))
        hidden = _MeanPenalty(name="penalty")(
            keras.layers.Dense(8, activation="tanh")(inputs))
        model = AccumulatingModel(inputs, keras.layers.Dense(3)(hidden),
                                  n_gradients=2)
        model.compile(optimizer="sgd", loss="mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert iterations(model) == 4
    assert not [w for w in caught if "add_loss" in str(w.message)]


class DoubledGradients(AccumulatingModel):
    """Scales the loss by 2 more than it unscales: twice the gradient."""

    def get_scaled_loss(self, loss):
        return super().get_scaled_loss(loss) * 2.0

    def get_unscaled_gradients(self, gradients):
        return super().get_unscaled_gradients(gradients)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_overridden_scaling_hooks_are_used(policy):
    x, y = regression_data(samples=64)
    keras.mixed_precision.set_global_policy(policy)

    def optimizer(learning_rate):
        if policy == "float32":
            return keras.optimizers.SGD(learning_rate)
        # At the default initial scale (2**15) the doubled loss overflows
        # float16 under Keras 2, as plain Keras 2's large batch with its
        # loss scaled twice over does; a lower scale leaves room.
        return LossScaleOptimizer(keras.optimizers.SGD(learning_rate),
                                  initial_scale=2.0**10)

    model = mlp(DoubledGradients, n_gradients=4)
    model.compile(optimizer=optimizer(0.05), loss="mse")
    reference = mlp(AccumulatingModel, n_gradients=4)
    reference.compile(optimizer=optimizer(0.1), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_weight_difference(model, reference) <= 1e-6


@pytest.mark.parametrize(
    "policy, loss_scaling",
    [("mixed_float16", "implicit"), ("mixed_float16", "explicit"),
     ("mixed_bfloat16", "none")],
)
def test_mixed_precision_under_two_replicas(two_replicas, policy,
                                            loss_scaling):
    x, y = regression_data(samples=96)
    make_optimizer = OPTIMIZERS["sgd"]
    if loss_scaling == "explicit":
        make_optimizer = _explicit_loss_scaling(make_optimizer)
    plain, accumulating = _fit_under(policy, make_optimizer, x, y,
                                     strategy=two_replicas)
    assert isinstance(accumulating.optimizer,
                      LossScaleOptimizer) == (
        loss_scaling != "none"
    )
    float32_model, _ = _float32_large_batch(OPTIMIZERS["sgd"], x, y)
    rounding = max_weight_difference(plain, float32_model)
    assert iterations(accumulating) == 6
    assert max_weight_difference(plain, accumulating) <= 2 * rounding + 1e-6


@pytest.mark.parametrize("replica_with_overflow", [0, 1])
def test_overflow_on_one_replica_skips_the_window_on_both(
    two_replicas, replica_with_overflow
):
    x, y = regression_data(samples=64)
    y = y.copy()
    # Micro-batch 6 (samples 40-47) splits 40-43 / 44-47 over the replicas.
    y[41 + 4 * replica_with_overflow] = 1e4
    keras.mixed_precision.set_global_policy("mixed_float16")
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
        first_window_only = mlp(AccumulatingModel, n_gradients=4)
        first_window_only.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    first_window_only.fit(x[:32], y[:32], batch_size=8, epochs=1,
                          shuffle=False, verbose=0)
    assert iterations(model) == counted_steps(2, 1)
    assert model.skipped_windows == 1
    assert loss_scale(model.optimizer) == 2.0**14
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert max_weight_difference(model, first_window_only) == 0.0


@keras_3_only("an optimizer's loss_scale_factor")
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_static_loss_scale_factor_matches_large_batch(policy, name):
    # The static scaling Keras recommends instead of a LossScaleOptimizer:
    # the loss is multiplied by `loss_scale_factor`, `apply` divides by it.
    x, y = regression_data(samples=96)
    rates = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}

    def make_optimizer():
        return rates[name](0.01, loss_scale_factor=128.0)

    keras.mixed_precision.set_global_policy(policy)
    try:
        plain, accumulating = fit_both(
            mlp, make_optimizer, x, y, micro_batch=8, n_gradients=4,
            compile_kwargs={"auto_scale_loss": False},
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    float32_model, _ = _float32_large_batch(
        lambda: rates[name](0.01), x, y)
    rounding = max_weight_difference(plain, float32_model)
    assert iterations(accumulating) == iterations(plain) == 6
    # A half-applied factor misses by 1e-3 (SGD) to 7e-3 (Adam).
    assert max_weight_difference(plain, accumulating) <= 2 * rounding + 1e-5


def _generator(x, y):
    for start in range(0, len(x), 8):
        yield x[start:start + 8], y[start:start + 8]


class _StopAtFifth(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 4:
            self.model.stop_training = True


@pytest.mark.parametrize("ending", ["end_of_data", "stop_training",
                                    "end_of_fit"])
def test_window_skipped_outside_the_training_step_is_in_the_logs(ending):
    # 40 samples: the window of micro-batch 5 (samples 32-39) overflows, and
    # is applied after the training step: when the data of unknown length
    # runs out, when a callback stops training, or when fit() ends.
    x, y = regression_data(samples=40)
    y = y.copy()
    y[35] = 1e4
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp(AccumulatingModel, n_gradients=4,
                flush_each_epoch=ending != "end_of_fit")
    model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    logged = {}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logged["epoch_end"] = logs["skipped_windows"]

        def on_train_end(self, logs=None):
            logged["train_end"] = logs["skipped_windows"]

    if ending == "end_of_data":
        data = _generator(x, y)
        if ON_TENSORFLOW:
            data = tf.data.Dataset.from_generator(
                lambda: _generator(x, y),
                output_signature=(tf.TensorSpec((None, 6)),
                                  tf.TensorSpec((None, 3))))
        history = model.fit(data, epochs=1, verbose=0, callbacks=[Record()])
    else:
        callbacks = [Record()] + ([_StopAtFifth()]
                                  if ending == "stop_training" else [])
        history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                            verbose=0, callbacks=callbacks)
    assert model.skipped_windows == 1
    assert iterations(model) == counted_steps(2, 1)
    assert history.history["skipped_windows"] == [1]
    assert logged == {"epoch_end": 1, "train_end": 1}


def _float8(model_class, **kwargs):
    model = mlp(model_class, **kwargs)
    model.quantize("float8")
    return model


@keras_3_only("float8 quantization")
def test_float8_statistics_take_the_windows_largest_value():
    # float8 amax histories and scales are "overwritten with their
    # gradient". Forward statistics of the window must be those of the large
    # batch; all of them take the largest micro-batch value, as Keras's own
    # `gradient_accumulation_steps` does, and none is averaged.
    x, y = regression_data(samples=64)
    large = _float8(keras.Model)
    large.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    keras_accumulation = _float8(keras.Model)
    keras_accumulation.compile(
        optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=4),
        loss="mse")
    model = _float8(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    keras_accumulation.set_weights(large.get_weights())
    model.set_weights(large.get_weights())
    large.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    keras_accumulation.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                           verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    statistics = [v.path for v in model.trainable_variables
                  if getattr(v, "overwrite_with_gradient", False)]
    assert statistics
    for ours, theirs in zip(model.trainable_variables,
                            large.trainable_variables):
        if "amax_history" in ours.path and "grad" not in ours.path:
            np.testing.assert_allclose(ours.numpy(), theirs.numpy(),
                                       rtol=1e-6)
    for ours, theirs in zip(model.trainable_variables,
                            keras_accumulation.trainable_variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5,
                                   atol=1e-6)


@jax_only("keras.distribution.DataParallel")
def test_float8_under_data_parallel_matches_one_device(two_replicas):
    # The step is one program over both devices: the statistics' window
    # maximum is the whole micro-batch's, as on one device.
    x, y = regression_data(samples=64)
    one_device = _float8(AccumulatingModel, n_gradients=4)
    one_device.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    one_device.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    with two_replicas.scope():
        model = _float8(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert iterations(model) == iterations(one_device) == 2
    for ours, theirs in zip(model.trainable_variables,
                            one_device.trainable_variables):
        np.testing.assert_allclose(numpy_of(ours), numpy_of(theirs),
                                   rtol=1e-5, atol=1e-6)


@keras_3_only("float8 quantization")
def test_float8_under_mixed_float16_is_never_scaled():
    # The float8 statistics are never loss-scaled, so no window overflows.
    # Plain keras 3.6 and 3.10 scale them and skip 18 of the 20 large
    # batches here; on TensorFlow the window still applies all 20; on JAX
    # the window goes through that Keras's own LossScaleOptimizer, and
    # skips exactly where its large batch does.
    x, y = regression_data(samples=160)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = _float8(keras.Model)
        plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        plain.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
        model = _float8(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    if not ON_TENSORFLOW and iterations(plain) < 20:
        assert iterations(model) == iterations(plain)
        assert model.skipped_windows == 20 - iterations(plain)
        return
    assert model.skipped_windows == 0
    assert iterations(model) == 20


def _one_large_target(target):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype("float32")
    y = rng.normal(size=(96, 1)).astype("float32")
    y[5, 0] = target
    return x, y


def _tanh_regression(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return model_class(inputs=inputs, outputs=keras.layers.Dense(1)(hidden),
                       **kwargs)


@pytest.mark.parametrize("target, large_batch_skips", [(12.0, 0), (40.0, 1)])
def test_micro_batches_overflow_where_the_large_batch_does(target,
                                                           large_batch_skips):
    # With the default scale (2**15), a micro-batch of 8 holding the large
    # target overflows if its loss is scaled by the whole scale; the large
    # batch of 32 does only for the larger target. Scaled by S/n, the
    # window skips exactly the windows the large batch skips.
    x, y = _one_large_target(target)
    models = {}
    for policy in ("float32", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        models[policy] = _tanh_regression(keras.Model)
        models[policy].compile(optimizer=keras.optimizers.Adam(0.01),
                               loss="mse")
        models[policy].fit(x, y, batch_size=32, epochs=3, shuffle=False,
                           verbose=0)
    accumulating = _tanh_regression(AccumulatingModel, n_gradients=4)
    accumulating.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    accumulating.set_weights(_tanh_regression(keras.Model).get_weights())
    accumulating.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    keras.mixed_precision.set_global_policy("float32")

    plain = models["mixed_float16"]
    windows = 3 * 3
    assert iterations(plain) == counted_steps(windows, large_batch_skips)
    assert iterations(accumulating) == iterations(plain)
    assert accumulating.skipped_windows == large_batch_skips
    assert loss_scale(accumulating.optimizer) == loss_scale(
        plain.optimizer)
    rounding = max_weight_difference(plain, models["float32"])
    assert max_weight_difference(plain, accumulating) <= 2 * rounding + 1e-6


def _skipped_steps(plain, steps):
    """The steps of `steps` that plain Keras skipped for overflow, from its
    default initial scale (2**15, halved by each, grown after 2,000 steps)
    where Keras 2 counts every step in `iterations`."""
    if ON_KERAS_2:
        return round(15 - math.log2(loss_scale(plain.optimizer)))
    return steps - iterations(plain)


def _scaled_data(data_scale, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(512, 8)) * 1.5 * data_scale).astype("float32")
    y = (rng.normal(size=(512, 1)) * data_scale).astype("float32")
    return x, y


def _two_relu_layers(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    hidden = keras.layers.Dense(32, activation="relu")(hidden)
    return model_class(inputs=inputs, outputs=keras.layers.Dense(1)(hidden),
                       **kwargs)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("data_scale, overflows", [(20.0, True),
                                                   (0.1, False)])
@pytest.mark.parametrize("policy", ["mixed_float16", "float16"])
def test_window_overflows_where_the_large_batchs_float16_sum_does(
        request, replicas, data_scale, overflows, policy):
    # The large batch sums its 32 samples' weight-gradient terms in float16
    # (float32 weights autocast in float16 layers, or float16 weights):
    # with inputs x30 and targets x20 that sum leaves float16's range at
    # scales where each micro-batch's sum of 8 does not. The window must
    # skip those windows too (and so lower the scale where the large batch
    # does).
    x, y = _scaled_data(data_scale)
    keras.mixed_precision.set_global_policy(policy)
    try:
        plain = _two_relu_layers(keras.Model)
        plain.compile(optimizer=LossScaleOptimizer(
            keras.optimizers.SGD(1e-7)), loss="mse")
        plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        scope = (request.getfixturevalue("two_replicas").scope()
                 if replicas == 2 else contextlib.nullcontext())
        with scope:
            model = _two_relu_layers(AccumulatingModel, n_gradients=4)
            model.compile(optimizer=LossScaleOptimizer(
                keras.optimizers.SGD(1e-7)), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    plain_skips = _skipped_steps(plain, 16)
    assert (plain_skips > 0) == overflows
    assert model.skipped_windows == plain_skips
    assert iterations(model) == iterations(plain)
    assert loss_scale(model.optimizer) == loss_scale(
        plain.optimizer)
    assert max_weight_difference(plain, model) <= 1e-5


@keras_3_only("compile's auto_scale_loss")
def test_loss_scaling_compiled_after_a_first_fit_checks_the_float16_sum():
    # The window built by a fit without loss scaling is kept; recompiled
    # with a LossScaleOptimizer, the window end must still skip where the
    # large batch's float16 gradient sum overflows.
    x, y = _scaled_data(20.0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = _two_relu_layers(keras.Model)
        plain.compile(optimizer=keras.optimizers.SGD(1e-7), loss="mse")
        plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        model = _two_relu_layers(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse",
                      auto_scale_loss=False)
        model.fit(x[:32], y[:32], batch_size=8, epochs=1, shuffle=False,
                  verbose=0)
        model.compile(optimizer=keras.optimizers.SGD(1e-7), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert 16 - iterations(plain) > 0
    assert model.skipped_windows == 16 - iterations(plain)
    assert iterations(model) == iterations(plain)
    assert max_weight_difference(plain, model) <= 1e-5


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size"])
def test_summed_loss_overflows_where_the_large_batch_does(reduction):
    # Each sample's term in the backward pass is 2 * 2.5 * scale. A summed
    # loss is not divided by the batch: in the large batch those terms
    # overflow float16 at the scales 2**15 and 2**14 and fit at 2**13, and
    # a micro-batch's must too (a mean's are divided by 32 in the large
    # batch, by 8 in a micro-batch: the window scales them by 1/4).
    rng = np.random.default_rng(0)
    x = (0.01 * rng.normal(size=(64, 4))).astype("float32")
    y = np.full((64, 1), 2.5, "float32")

    def build(model_class, **kwargs):
        inputs = keras.Input((4,))
        # No bias: its gradient would sum the terms in float16 over the
        # batch, overflowing by itself.
        outputs = keras.layers.Dense(1, use_bias=False,
                                     kernel_initializer="zeros")(inputs)
        return model_class(inputs=inputs, outputs=outputs, **kwargs)

    keras.mixed_precision.set_global_policy("mixed_float16")
    plain, model = fit_both(build, lambda: keras.optimizers.SGD(1e-4), x, y,
                            micro_batch=8, n_gradients=4, epochs=2,
                            loss=keras.losses.MeanSquaredError(
                                reduction=reduction))
    assert loss_scale(model.optimizer) == loss_scale(plain.optimizer) == (
        2.0**13 if reduction == "sum" else 2.0**15)
    assert iterations(model) == iterations(plain)
    assert max_weight_difference(plain, model) <= 1e-6


def _shared_dense(model_class, shared_dtype=None, **kwargs):
    """Dense, then one Dense called twice (its weights used twice in a
    step), then Dense: the fuzzer's `two_dense_shared`."""
    keras.utils.set_random_seed(10)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    shared = keras.layers.Dense(16, activation="tanh", dtype=shared_dtype,
                                name="shared")
    outputs = keras.layers.Dense(3)(shared(shared(hidden)))
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def _float16_messages(model, x, y, sample_weight, batch_size):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size,
                  epochs=1, shuffle=False, verbose=0)
    return [str(w.message) for w in caught
            if "more than once in a step" in str(w.message)]


@pytest.mark.parametrize("policy, shared_dtype, named", [
    ("mixed_float16", None, True),
    ("mixed_float16", "float32", False),
    ("mixed_bfloat16", None, False)])
def test_weights_used_twice_under_float16_loss_scaling_are_named(
        policy, shared_dtype, named):
    # Two samples in micro-batches of one: the shared kernel's summed
    # gradient passes float16's range times the loss scale, and the window
    # was skipped where the large batch, whose two uses each fit, was not
    # (0.1 apart, keras 3.15.1 on torch).
    rng = np.random.default_rng(10)
    x = rng.normal(size=(2, 6)).astype("float32")
    y = rng.normal(size=(2, 3)).astype("float32")
    sample_weight = rng.uniform(0.5, 2.0, 2).astype("float32")
    keras.mixed_precision.set_global_policy(policy)
    try:
        plain = _shared_dense(keras.Model, shared_dtype)
        plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        plain.fit(x, y, sample_weight=sample_weight, batch_size=2,
                  epochs=1, shuffle=False, verbose=0)
        model = _shared_dense(AccumulatingModel, shared_dtype,
                              n_gradients=2)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        said = _float16_messages(model, x, y, sample_weight, 1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert len(said) == named
    if named:
        assert "['shared']" in said[0] and "dtype='float32'" in said[0]
    else:
        # What the warning offers is exact: the large batch's update.
        assert iterations(model) == iterations(plain) == 1
        assert max_weight_difference(model, plain) <= 1e-3
