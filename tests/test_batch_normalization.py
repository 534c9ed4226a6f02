"""BatchNormalization's moving statistics are the large batch's.

Within a window the weights do not change, so at learning rate 0 every
micro-batch sees what the large batch's slice would: the window's moving
mean and variance must then equal plain Keras's with the large batch, on one
device and under two replicas (where plain Keras itself keeps per-replica
statistics). With a learning rate the forward pass still normalises each
micro-batch by its own statistics, which `fit()` says once.
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model._chooser import adapter
from backends import ON_TENSORFLOW
from backends import tensorflow_only
from helpers import numpy_of

pytestmark = pytest.mark.skipif(
    not adapter.pools_moving_statistics(keras.layers.BatchNormalization()),
    reason="this Keras's BatchNormalization moves its own statistics",
)

TOLERANCE = 1e-5


def conv_bn(model_class, momentum=0.9, synchronized=False, **kwargs):
    """Conv2D, BatchNormalization, ReLU, pooling, Dense: the CNN lane."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    hidden = keras.layers.BatchNormalization(
        momentum=momentum, synchronized=synchronized, name="norm"
    )(hidden)
    hidden = keras.layers.ReLU()(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    return model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)


def masked_tokens_bn(model_class, **kwargs):
    """Embedding(mask_zero), BatchNormalization, pooling, Dense."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((7,), dtype="int32")
    hidden = keras.layers.Embedding(20, 3, mask_zero=True)(inputs)
    hidden = keras.layers.BatchNormalization(momentum=0.8,
                                             name="norm")(hidden)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)


def image_data(samples=96, seed=0):
    rng = np.random.default_rng(seed)
    # Far from the initial moving mean, as real activations are.
    x = (rng.normal(size=(samples, 6, 6, 2)) * 2.0 + 3.0).astype("float32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    return x, y


def statistics(model, name="norm"):
    layer = model.get_layer(name)
    return [numpy_of(layer.moving_mean), numpy_of(layer.moving_variance)]


def max_difference(arrays_a, arrays_b):
    return max(float(np.max(np.abs(a - b)))
               for a, b in zip(arrays_a, arrays_b))


def fit_quietly(model, x, y, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.fit(x, y, shuffle=False, verbose=0, **kwargs)


def large_batch_and_window(build, x, y, micro_batch, n_gradients,
                           learning_rate=0.0, strategy=None, epochs=2):
    """Plain Keras on one device with batches of n*b; windows of n x b."""
    plain = build(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    plain.fit(x, y, batch_size=micro_batch * n_gradients, epochs=epochs,
              shuffle=False, verbose=0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build(AccumulatingModel, n_gradients=n_gradients)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                      loss="mse")
        fit_quietly(model, x, y, batch_size=micro_batch, epochs=epochs)
    return plain, model


@pytest.mark.parametrize("micro_batch,n_gradients,samples", [
    (2, 16, 96), (4, 8, 96), (8, 4, 96),
    (8, 4, 100),  # a short last micro-batch, in a short last window
])
def test_moving_statistics_equal_the_large_batch(micro_batch, n_gradients,
                                                 samples):
    x, y = image_data(samples)
    plain, model = large_batch_and_window(conv_bn, x, y, micro_batch,
                                          n_gradients)
    assert max_difference(statistics(plain), statistics(model)) <= TOLERANCE
    # The statistics moved from their initial 0 and 1.
    assert max_difference(statistics(model), [np.zeros(4), np.ones(4)]) > 0.1


def test_micro_batch_updates_would_differ():
    # What the test above guards against: n momentum steps per window, from
    # the micro-batches' statistics, land elsewhere.
    x, y = image_data()
    plain = conv_bn(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    micro = conv_bn(keras.Model)
    micro.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    micro.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_difference(statistics(plain), statistics(micro)) > 0.1


def test_statistics_stay_still_within_a_window():
    x, y = image_data()
    model = conv_bn(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    before = statistics(model)
    for step in range(3):
        model.train_on_batch(x[4 * step:4 * step + 4],
                             y[4 * step:4 * step + 4])
        assert max_difference(before, statistics(model)) == 0.0
    model.train_on_batch(x[12:16], y[12:16])
    moved = statistics(model)
    assert max_difference(before, moved) > 0.1
    plain = conv_bn(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    plain.train_on_batch(x[:16], y[:16])
    assert max_difference(statistics(plain), moved) <= TOLERANCE


@pytest.mark.parametrize("synchronized", [
    False, pytest.param(True, marks=tensorflow_only(
        "synchronized=True is TensorFlow's"))])
@pytest.mark.parametrize("samples", [
    96, pytest.param(99, marks=tensorflow_only(  # replicas split unevenly
        "DataParallel splits batches equally"))])
def test_two_replicas_equal_one_device_large_batch(two_replicas,
                                                   synchronized, samples):
    x, y = image_data(samples)

    def build(model_class, **kwargs):
        return conv_bn(model_class, synchronized=synchronized, **kwargs)

    plain, model = large_batch_and_window(build, x, y, 8, 4,
                                          strategy=two_replicas)
    assert max_difference(statistics(plain), statistics(model)) <= TOLERANCE


def test_mask_excludes_padded_steps():
    # Embedding(mask_zero) hands BatchNormalization the padding mask; its
    # moments leave padded steps out, and so does the window's pooling.
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 20, size=(64, 7))
    lengths = rng.integers(1, 8, size=64)
    tokens[np.arange(7)[None, :] >= lengths[:, None]] = 0
    y = rng.normal(size=(64, 1)).astype("float32")

    plain, model = large_batch_and_window(masked_tokens_bn, tokens, y, 4, 4)
    assert max_difference(statistics(plain), statistics(model)) <= TOLERANCE
    unmasked = masked_tokens_bn(keras.Model)
    unmasked.get_layer("norm").supports_masking = False
    assert max_difference(statistics(plain), statistics(unmasked)) > 0


def test_a_layer_called_twice_moves_twice_per_window():
    # Both calls see inputs no batch statistic has touched, so at learning
    # rate 0 their slices are the large batch's (a BN after a training BN
    # sees micro-batch-normalised inputs: not comparable).
    def build(model_class, **kwargs):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        norm = keras.layers.BatchNormalization(momentum=0.7, name="norm")
        first = norm(keras.layers.Dense(5)(inputs))
        second = norm(keras.layers.Dense(5, activation="tanh")(inputs) * 3.0)
        hidden = keras.layers.Concatenate()([first, second])
        return model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)

    rng = np.random.default_rng(2)
    x = (rng.normal(size=(64, 5)) + 2.0).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    plain, model = large_batch_and_window(build, x, y, 4, 4)
    assert max_difference(statistics(plain), statistics(model)) <= TOLERANCE


class _NormTwiceLayers:
    """Calls one BatchNormalization twice, where no functional graph shows."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization(name="norm")
        self.head = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        return self.head(keras.ops.concatenate(
            [self.norm(inputs, training=training),
             self.norm(inputs * 2.0, training=training)], axis=-1))


class _NormTwice(_NormTwiceLayers, AccumulatingModel):
    pass


class _PlainNormTwice(_NormTwiceLayers, keras.Model):
    pass


@pytest.mark.skipif(ON_TENSORFLOW,
                    reason="TensorFlow pools every call, seen in its trace")
def test_a_layer_called_twice_outside_a_graph_is_warned_about():
    # Warned, its statistics move per micro-batch, call by call, as plain
    # Keras's at the micro-batch move them.
    x = np.random.default_rng(3).normal(size=(16, 5)).astype("float32")
    model = _NormTwice(n_gradients=2)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    with pytest.warns(UserWarning,
                      match="functional graph does not show.*norm .called 2"):
        model.fit(x, x[:, :1], batch_size=4, shuffle=False, verbose=0)
    plain = _PlainNormTwice()
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    plain.fit(x, x[:, :1], batch_size=4, shuffle=False, verbose=0)
    assert max_difference(statistics(plain), statistics(model)) <= TOLERANCE
    assert float(numpy_of(model.norm.moving_mean)[0]) != 0.0


def test_mixed_float16_statistics_equal_the_mixed_large_batch():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = image_data()
    plain, model = large_batch_and_window(conv_bn, x, y, 4, 4)
    assert max_difference(statistics(plain), statistics(model)) <= 1e-4


def test_training_with_a_learning_rate_stays_close():
    # With a learning rate the micro-batches' normalisation makes gradients
    # differ (the warning's subject); statistics stay near the large batch's.
    x, y = image_data()
    plain, model = large_batch_and_window(conv_bn, x, y, 8, 4,
                                          learning_rate=0.05)
    assert max_difference(statistics(plain), statistics(model)) <= 0.05
    assert int(numpy_of(model.optimizer.iterations)) == 6


def test_resume_in_the_middle_of_a_window_keeps_its_statistics(tmp_path):
    x, y = image_data(64)
    plain = conv_bn(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    plain.train_on_batch(x[:16], y[:16])
    model = conv_bn(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    for step in range(2):
        model.train_on_batch(x[4 * step:4 * step + 4],
                             y[4 * step:4 * step + 4])
    file = str(tmp_path / "mid_window.weights.h5")
    model.save_weights(file)
    resumed = conv_bn(AccumulatingModel, n_gradients=4)
    resumed.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    resumed.load_weights(file)
    for step in range(2, 4):
        resumed.train_on_batch(x[4 * step:4 * step + 4],
                               y[4 * step:4 * step + 4])
    assert resumed._accumulation.open_micro_steps() == 0
    assert max_difference(statistics(plain), statistics(resumed)) <= TOLERANCE


class _OutOfNameOrder:
    """A subclassed model of two BatchNormalization layers, made and called
    in the reverse of their names' order."""

    def __init__(self, **kwargs):
        super().__init__(name="out_of_order", **kwargs)
        self.wide = keras.layers.BatchNormalization(name="b_norm")
        self.narrow = keras.layers.BatchNormalization(name="a_norm")
        self.head = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        return self.head(keras.ops.concatenate(
            [self.wide(inputs * 2.0, training=training),
             self.narrow(inputs[:, :2], training=training)], axis=-1))


class _PlainOutOfNameOrder(_OutOfNameOrder, keras.Model):
    pass


class _NormsOutOfNameOrder(_OutOfNameOrder, AccumulatingModel):
    pass


def _out_of_name_order(model_class, **kwargs):
    keras.utils.set_random_seed(4)
    return (_PlainOutOfNameOrder if model_class is keras.Model
            else _NormsOutOfNameOrder)(**kwargs)


def test_a_subclassed_model_pools_like_the_large_batch():
    # Keras builds a subclassed model in its first training call, through
    # a symbolic call of each layer whose moments are no micro-batch's.
    x = (np.random.default_rng(1).normal(size=(64, 5)) + 1.0).astype(
        "float32")
    plain, model = large_batch_and_window(_out_of_name_order, x, x[:, :1], 4,
                                          4)
    for name in ("a_norm", "b_norm"):
        assert max_difference(statistics(plain, name),
                              statistics(model, name)) <= TOLERANCE


def test_files_hold_the_statistics_in_the_order_of_the_layers_names():
    # TensorFlow keeps the statistics in call order, JAX and PyTorch in the
    # model's layer order; a file saved on one backend must restore on
    # another, so files sort them by layer name: a_norm's [3, 2] (count,
    # sum, sum of squares, shifted by the moving mean 0), then b_norm's.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype("float32")
    model = _NormsOutOfNameOrder(n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    for step in range(2):
        model.train_on_batch(x[4 * step:4 * step + 4],
                             x[4 * step:4 * step + 4, :1])
    saved = np.asarray(model._window_checkpoint.saved_state()["statistics"])

    def block(values):
        return np.stack([np.full(values.shape[1], len(values)),
                         values.sum(axis=0), (values ** 2).sum(axis=0)])

    expected = np.concatenate([block(x[:, :2]).ravel(),
                               block(2.0 * x).ravel()])
    np.testing.assert_allclose(saved, expected, rtol=1e-5, atol=1e-5)


def test_frozen_batch_normalization_stays_exact_and_still():
    x, y = image_data()

    def build(model_class, **kwargs):
        model = conv_bn(model_class, **kwargs)
        model.get_layer("norm").trainable = False
        return model

    plain, model = large_batch_and_window(build, x, y, 8, 4,
                                          learning_rate=0.05)
    assert max_difference(plain.get_weights(), model.get_weights()) <= 1e-5
    assert max_difference(statistics(model), [np.zeros(4), np.ones(4)]) == 0


def test_a_window_saved_without_statistics_says_what_it_misses():
    # A checkpoint's open window saved by a model whose layers moved their
    # own statistics (no "statistics" entry) cannot give the window the
    # moments of its first micro-batches: resuming says so.
    x, y = image_data(16)
    model = conv_bn(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.train_on_batch(x[:4], y[:4])
    saved = model._accumulation.checkpoint.saved_state()
    assert saved["statistics"].size == 3 * 4  # count, sum, squares x 4
    del saved["statistics"]
    resumed = conv_bn(AccumulatingModel, n_gradients=4)
    resumed.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    resumed.train_on_batch(x[:4], y[:4])
    resumed.apply_open_window()
    with pytest.warns(UserWarning, match="no BatchNormalization statistics"):
        resumed._accumulation.checkpoint.restore_state(saved)
    assert resumed._accumulation.open_micro_steps() == 1
