"""Two replicas equal one device with the large batch: MirroredStrategy on
two logical CPUs (TensorFlow), `keras.distribution.DataParallel` on two CPU
devices (JAX)."""

import contextlib
import warnings

import numpy as np
import pytest

from accum_model import AccumulatingModel
from backends import ON_KERAS_2
from backends import jax_only
from backends import keras_2_too
from backends import keras_3_only
from backends import tensorflow_only
from helpers import BatchMeanLoss
from helpers import aligned_copy
from helpers import fit_both
from helpers import iterations
from helpers import keras
from helpers import max_weight_difference
from helpers import mlp
from helpers import numpy_of
from helpers import regression_data
from helpers import scalar_output_mlp
from test_batch_normalization import conv_bn
from test_batch_normalization import image_data
from test_batch_normalization import masked_tokens_bn
from test_exactness import OPTIMIZERS
from test_exactness import _masked_lstm
from test_exactness import _padded_sequences

pytestmark = keras_2_too

TOLERANCE = 1e-5


@pytest.mark.parametrize(
    "name", ["sgd", "adam", "rmsprop_clipnorm", "adam_global_clipnorm",
             "sgd_clipvalue"]
)
def test_two_replicas_match_one_device_large_batch(name, two_replicas):
    # 100 samples: the last micro-batch (4 samples) is split 2 + 2.
    x, y = regression_data(samples=100)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS[name], x, y, micro_batch=8, n_gradients=4,
        epochs=2, strategy=two_replicas,
    )
    assert iterations(accumulating) == iterations(plain) == 8
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def _regularized_mlp(where):
    def build(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh", **{
            f"{where}_regularizer": keras.regularizers.L2(0.05)})(inputs)
        return model_class(inputs=inputs,
                           outputs=keras.layers.Dense(3)(hidden), **kwargs)
    return build


@pytest.mark.parametrize("where", ["kernel", "activity"])
def test_regularized_layers_under_two_replicas_match_one_device(
        where, two_replicas):
    # On JAX each device's copy of a regularized weight has the same
    # penalty, counted once; each device's share of an activity penalty
    # adds up to the whole batch's, as plain Keras's step takes it.
    if where == "activity" and not ON_KERAS_2:
        from accum_model.keras3.losses import activity_penalty_is_a_mean

        if not activity_penalty_is_a_mean():
            pytest.skip("this Keras sums an activity penalty over the batch")
    x, y = regression_data(samples=64)
    plain, accumulating = fit_both(
        _regularized_mlp(where), OPTIMIZERS["adam"], x, y, micro_batch=8,
        n_gradients=4, epochs=2, strategy=two_replicas)
    assert iterations(accumulating) == iterations(plain) == 4
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


@tensorflow_only("a MirroredStrategy splits a batch unevenly (JAX's "
                 "DataParallel refuses: tested below)")
def test_uneven_split_across_replicas(two_replicas):
    # The last micro-batch (3 samples) splits 2 + 1: each replica divides its
    # loss by its own sample count, which the window weighting undoes.
    x, y = regression_data(samples=99)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["sgd"], x, y, micro_batch=8, n_gradients=4,
        epochs=1, strategy=two_replicas,
    )
    assert iterations(accumulating) == iterations(plain) == 4
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


@tensorflow_only("a MirroredStrategy splits a batch unevenly")
def test_every_micro_batch_split_unevenly(two_replicas):
    # Micro-batches of 7 split 4 + 3, from the first one on (plain Keras
    # 3.15.1 cannot even build from such a first batch under the strategy).
    x, y = regression_data(samples=98)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["sgd"], x, y, micro_batch=7, n_gradients=2,
        epochs=1, strategy=two_replicas,
    )
    assert iterations(accumulating) == iterations(plain) == 7
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


@jax_only("keras.distribution.DataParallel")
@pytest.mark.parametrize("samples, batch_size", [(99, 8), (98, 7)])
def test_data_parallel_refuses_micro_batches_it_cannot_split_equally(
        two_replicas, samples, batch_size):
    # Plain Keras fails on such a micro-batch only when it comes, after
    # some updates; the window is refused before the first.
    x, y = regression_data(samples=samples)
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
        before = model.get_weights()
        with pytest.raises(ValueError, match="multiple of 2.*batch_size"):
            model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    assert iterations(model) == 0
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


@jax_only("keras.distribution.ModelParallel")
@pytest.mark.distributed
def test_model_parallel_matches_one_device_large_batch():
    # Each kernel is cut across the two devices; the window's gradient sums
    # are laid out as their variables.
    import jax

    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs two JAX devices")
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         devices=devices[:2])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["head/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")

    def build(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh",
                                    name="hidden")(inputs)
        outputs = keras.layers.Dense(3, name="head")(hidden)
        return model_class(inputs=inputs, outputs=outputs, **kwargs)

    x, y = regression_data(samples=100)
    plain, accumulating = fit_both(
        build, OPTIMIZERS["adam_global_clipnorm"], x, y, micro_batch=8,
        n_gradients=4, epochs=2, strategy=distribution)
    assert iterations(accumulating) == iterations(plain) == 8
    assert max_weight_difference(plain, accumulating) <= TOLERANCE
    specs = [tuple(total.sharding.spec) for total in
             accumulating._accumulation.window.state.gradient_sums]
    assert specs == [tuple(v.value.sharding.spec)
                     for v in accumulating.trainable_variables]
    assert (None, "model") in specs


def test_masked_sequences_with_different_valid_counts_per_replica(
    two_replicas,
):
    x, y = _padded_sequences()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = _masked_lstm(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss)
    with two_replicas.scope():
        accumulating = _masked_lstm(AccumulatingModel, n_gradients=4)
        accumulating.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss)
    accumulating.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with two_replicas.scope():
        accumulating.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                         verbose=0)
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def _token_classifier(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(10, 4)(inputs)
    return model_class(inputs, keras.layers.Dense(4)(embedded), **kwargs)


def _scalar_mean_token_loss(y_true, y_pred):
    ops = keras.backend if ON_KERAS_2 else keras.ops
    return ops.mean(keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True))


@pytest.mark.parametrize("loss", ["ignore_class", "sum", "sample_weights",
                                  "scalar_own"])
def test_evaluation_under_two_replicas_is_one_devices(loss, two_replicas):
    # Each replica's half of a batch has its own count of valid labels:
    # Keras's evaluation under a MirroredStrategy averaged the replicas'
    # own means (1.3829 where one device gives 1.3909). A loss of one's own
    # that is one number for each replica's share (batches of 7 split 4
    # and 3 on TensorFlow; JAX splits equally) is weighed by its samples,
    # which count its elements here. Keras 3.6 logs the first replica's
    # loss tracker alone: there each replica's loss, and its weight, must
    # be the whole batch's (the first replica's own gave 1.3842 for 1.3866
    # with batches of 8).
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, (24, 5))
    y = rng.integers(0, 4, (24, 5))
    y[:4, :4] = 0
    sample_weight = None
    batch_size = (7 if loss == "scalar_own"
                  and keras.backend.backend() == "tensorflow" else 8)
    options = dict(from_logits=True)
    if loss == "ignore_class":
        options["ignore_class"] = 0
    elif loss == "sum":
        options["reduction"] = "sum"
    elif loss == "sample_weights":
        # One weight a token (Keras takes no weight a sample here).
        sample_weight = np.repeat(
            np.where(np.arange(24) % 8 < 4, 3.0, 0.5)[:, None], 5, axis=1)

    def make_loss():
        if loss == "scalar_own":
            return _scalar_mean_token_loss
        return keras.losses.SparseCategoricalCrossentropy(**options)

    one_device = _token_classifier(keras.Model)
    one_device.compile(optimizer="sgd", loss=make_loss())
    with two_replicas.scope():
        model = _token_classifier(AccumulatingModel, n_gradients=2)
        model.compile(optimizer="sgd", loss=make_loss())
        with warnings.catch_warnings():
            # The scalar loss's warning in training.
            warnings.simplefilter("ignore")
            history = model.fit(x, y, sample_weight=sample_weight,
                                batch_size=4, epochs=1, shuffle=False,
                                verbose=0,
                                validation_data=(x, y, sample_weight),
                                validation_batch_size=batch_size)
        evaluated = model.evaluate(x, y, sample_weight=sample_weight,
                                   batch_size=batch_size, verbose=0)
    one_device.set_weights(model.get_weights())
    expected = one_device.evaluate(x, y, sample_weight=sample_weight,
                                   batch_size=batch_size, verbose=0)
    assert abs(evaluated - expected) <= TOLERANCE * abs(expected)
    assert (abs(history.history["val_loss"][0] - expected)
            <= TOLERANCE * abs(expected))


def _masked_tokens(samples):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 20, size=(samples, 7))
    # The first half of each micro-batch long, the second short: each
    # device's share has its own count of valid steps.
    lengths = np.where(np.arange(samples) % 8 < 4, 7, 2)
    tokens[np.arange(7)[None, :] >= lengths[:, None]] = 0
    return tokens, rng.normal(size=(samples, 1)).astype("float32")


@jax_only("each device's pass normalizes by the whole micro-batch's "
          "moments, as Keras's DataParallel step does (under a "
          "MirroredStrategy each replica normalizes by its own share's)")
@pytest.mark.parametrize("build, data", [
    (conv_bn, image_data), (masked_tokens_bn, _masked_tokens)],
    ids=["images", "masked"])
def test_batch_normalization_trains_under_two_replicas_as_on_one_device(
        two_replicas, build, data):
    # With a learning rate each micro-batch is normalized by its own
    # moments, so the reference is the window on one device.
    x, y = data(64)

    def trained(strategy):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build(AccumulatingModel, n_gradients=4)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                      verbose=0)
        return model

    one_device, two_devices = trained(None), trained(two_replicas)
    assert iterations(two_devices) == 4
    assert max_weight_difference(one_device, two_devices) <= TOLERANCE
    norm = [two_devices.get_layer("norm"), one_device.get_layer("norm")]
    for name in ("moving_mean", "moving_variance"):
        moved, reference = (numpy_of(getattr(layer, name)) for layer in norm)
        assert np.max(np.abs(moved - reference)) <= TOLERANCE


@jax_only("keras.distribution.DataParallel runs one pass per device")
def test_a_random_layer_draws_apart_on_each_device(two_replicas):
    # Dropout(0.5) on ones, then w * h: a window of 4 samples moves w by a
    # factor 1 - 2 * learning_rate * k, k the samples kept. Were both
    # devices to draw the same mask for their shares, k would always be
    # even.
    learning_rate = 0.01

    def build(model_class, **kwargs):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((1,))
        hidden = keras.layers.Dropout(0.5, name="dropout")(inputs)
        outputs = keras.layers.Dense(1, use_bias=False,
                                     kernel_initializer="ones")(hidden)
        return model_class(inputs, outputs, **kwargs)

    x, y = np.ones((4, 1), "float32"), np.zeros((4, 1), "float32")
    with two_replicas.scope():
        model = build(AccumulatingModel, n_gradients=2)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                      loss="mse")
        generator = model.get_layer("dropout").seed_generator
        seed = int(numpy_of(generator.state)[0])
        kept = []
        for _ in range(16):
            # One window an epoch (fit(): keras 3.10.0's train_on_batch
            # fails under a distribution without sample weights).
            before = float(model.get_weights()[0][0, 0])
            model.fit(x, y, batch_size=2, epochs=1, shuffle=False,
                      verbose=0)
            after = float(model.get_weights()[0][0, 0])
            kept.append(round((1 - after / before) / (2 * learning_rate)))
    assert set(kept) <= {0, 1, 2, 3, 4}
    assert any(count % 2 for count in kept), kept
    # The seed moves on once per micro step, as in Keras's own step.
    assert numpy_of(generator.state).tolist() == [seed, 32]


def test_run_eagerly_under_two_replicas(two_replicas):
    x, y = regression_data(samples=48)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["adam"], x, y, micro_batch=8, n_gradients=3,
        epochs=1, strategy=two_replicas,
        compile_kwargs={"run_eagerly": True},
    )
    assert iterations(accumulating) == iterations(plain) == 2
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_subclassed_model_under_two_replicas(two_replicas):
    from test_exactness import SubclassedNet

    x, y = regression_data(samples=64)
    keras.utils.set_random_seed(3)
    with two_replicas.scope():
        accumulating = SubclassedNet(n_gradients=4)
        accumulating.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
        accumulating.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                         verbose=0)
    assert iterations(accumulating) == 2
    assert np.all(np.isfinite(accumulating.get_weights()[0]))


@tensorflow_only("tf.distribute's datasets from a function")
@keras_3_only("Keras 2's fit() takes a distributed dataset only with "
              "steps_per_epoch, which never reaches the empty last step")
@pytest.mark.parametrize("flush_each_epoch", [True, False])
def test_datasets_from_a_function_match_one_device(two_replicas,
                                                   flush_each_epoch):
    # Each replica reads batches of 4 from the function's dataset, so a
    # micro-batch is 8 samples in order; at the end of the data TensorFlow
    # runs one more step in which both replicas are empty. That step must be
    # no micro step: no NaN, no extra update, no shifted window.
    x, y = regression_data(samples=80)
    micro = [list(range(i, i + 8)) for i in range(0, 80, 8)]

    import tensorflow as tf

    def dataset_fn(context):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(
            context.get_per_replica_batch_size(8))

    epochs = 3
    per_epoch = micro * epochs
    if flush_each_epoch:
        windows = [sum(micro[i:i + 4], []) for i in (0, 4, 8)] * epochs
    else:
        windows = [sum(per_epoch[i:i + 4], []) for i in range(0, 30, 4)]
    plain = mlp(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    for window in windows:
        plain.train_on_batch(x[window], y[window])
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4,
                    flush_each_epoch=flush_each_epoch)
        model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    data = two_replicas.distribute_datasets_from_function(dataset_fn)
    try:
        model.fit(data, epochs=epochs, verbose=0)
    except ValueError as error:
        if "Unrecognized data type" not in str(error):
            raise
        pytest.skip("this Keras's fit() does not take distributed datasets")
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert iterations(model) == len(windows)
    assert max_weight_difference(plain, model) <= TOLERANCE


@tensorflow_only("tf.data generators under a MirroredStrategy")
def test_a_generator_of_views_of_the_users_arrays_is_left_alone(
        two_replicas):
    # A generator that yields slices of the user's arrays: TensorFlow hands
    # a replica its share without a copy where the array is 64-byte aligned
    # (malloc's choice, so about one process in three), and an op that
    # reuses its input's buffer would write into the user's targets, which
    # the second epoch then reads (plain Keras under the strategy too).
    import tensorflow as tf

    x, y = regression_data(samples=128)
    plain = mlp(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    x, y = aligned_copy(x), aligned_copy(y)
    x_before, y_before = x.copy(), y.copy()

    def slices():
        for start in range(0, 128, 16):
            yield x[start:start + 16], y[start:start + 16]

    data = tf.data.Dataset.from_generator(slices, output_signature=(
        tf.TensorSpec((None, 6), tf.float32),
        tf.TensorSpec((None, 3), tf.float32)))
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
        model.fit(data, epochs=2, verbose=0)
    np.testing.assert_array_equal(y, y_before)
    np.testing.assert_array_equal(x, x_before)
    assert iterations(model) == 4
    assert max_weight_difference(plain, model) <= TOLERANCE


@pytest.mark.parametrize("shape", [
    "scalar_output",
    pytest.param("batch_mean_loss",
                 marks=keras_3_only("the loss is written with keras.ops"))])
def test_losses_keras_leaves_undivided_match_one_device(two_replicas, shape):
    # Keras divides a reduced loss by the replicas, but not one that is a
    # scalar before reduction; the window must equal one device either way.
    x, y = regression_data(samples=96, outputs=1)
    if shape == "scalar_output":
        build, loss, y = scalar_output_mlp, "mse", y[:, 0]
    else:
        build, loss = mlp, BatchMeanLoss()

    def make(model_class, **kwargs):
        if build is mlp:
            return mlp(model_class, outputs=1, **kwargs)
        return build(model_class, **kwargs)

    plain = make(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss)
    with two_replicas.scope():
        model = make(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss)
    model.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with two_replicas.scope():
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                            verbose=0)
    assert iterations(model) == iterations(plain) == 6
    assert max_weight_difference(plain, model) <= TOLERANCE
    # The reported loss is one device's too, not twice it (plain keras 3.6's
    # own step logs 0.9007 under two replicas where one device logs 0.8829,
    # same weights, learning rate 0).
    one_device = make(AccumulatingModel, n_gradients=4)
    one_device.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss)
    one_device.set_weights(make(keras.Model).get_weights())
    one_device_history = one_device.fit(x, y, batch_size=8, epochs=2,
                                        shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"],
                               one_device_history.history["loss"], rtol=1e-5)


def test_logged_loss_with_uneven_replica_shares_is_one_devices(two_replicas):
    # Batches of 7 split 4 and 3 on TensorFlow, and the last of 50 samples
    # 1 and 0 (JAX splits batches of 8 equally): each window's loss counts
    # by the whole window's samples, also where Keras logs the first
    # replica's tracker alone (keras 3.6).
    batch_size = 7 if keras.backend.backend() == "tensorflow" else 8
    x, y = regression_data(samples=50)
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=3)
        model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    one_device = mlp(AccumulatingModel, n_gradients=3)
    one_device.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    one_device.set_weights(model.get_weights())
    with two_replicas.scope():
        history = model.fit(x, y, batch_size=batch_size, epochs=2,
                            shuffle=False, verbose=0)
    expected = one_device.fit(x, y, batch_size=batch_size, epochs=2,
                              shuffle=False, verbose=0)
    assert max_weight_difference(one_device, model) <= TOLERANCE
    np.testing.assert_allclose(history.history["loss"],
                               expected.history["loss"], rtol=1e-5)


@tensorflow_only("tf.distribute strategies")
@pytest.mark.parametrize("kind", ["mirrored_one_device", "one_device"])
def test_strategies_over_one_device_match_the_large_batch(kind):
    # A strategy with a single replica has nothing to reduce: the window
    # end uses its sums as they are, in either context.
    import tensorflow as tf

    strategy = (tf.distribute.MirroredStrategy(["/cpu:0"])
                if kind == "mirrored_one_device"
                else tf.distribute.OneDeviceStrategy("/cpu:0"))
    x, y = regression_data(samples=100)

    def optimizer():
        return keras.optimizers.Adam(0.01, clipnorm=0.05)

    plain = mlp(keras.Model)
    plain.compile(optimizer=optimizer(), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = mlp(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=optimizer(), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert iterations(model) == iterations(plain) == 8
    assert max_weight_difference(plain, model) <= TOLERANCE



@tensorflow_only("a Python generator under a MirroredStrategy")
def test_every_micro_batch_of_a_python_generator_trains(two_replicas):
    # Keras builds the model before training from a batch it takes from the
    # generator's iterator, which reads ahead and is then dropped: batches
    # of the generator never reach training (plain Keras too). The window
    # builds from the data's specification and sees all ten micro-batches
    # (windows of 4, 4 and 2).
    x, y = regression_data(samples=20)
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    def micro_batches():
        for start in range(0, 20, 2):
            yield x[start:start + 2], y[start:start + 2]

    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for _ in range(2):
        model.fit(micro_batches(), epochs=1, shuffle=False, verbose=0)
    assert iterations(model) == iterations(plain) == 6
    assert max_weight_difference(plain, model) <= TOLERANCE


class _TemperatureLoss(keras.layers.Layer):
    """Holds a learnable temperature that the loss reads."""

    def build(self, input_shape):
        self.temperature = self.add_weight(shape=(), initializer="ones")

    def call(self, inputs):
        return inputs


@keras_3_only("keras.ops in the loss")
@pytest.mark.parametrize("reads", ["kernel_penalty", "temperature"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_loss_that_reads_weights_matches_one_device(reads, replicas,
                                                      request):
    # The loss's own path to a weight, besides the predictions': under
    # DataParallel each device's pass gives the predictions' part, and the
    # loss's own part is the whole micro-batch's.
    strategy = (request.getfixturevalue("two_replicas") if replicas == 2
                else None)

    def build(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh",
                                    name="hidden")(inputs)
        outputs = _TemperatureLoss(name="held")(keras.layers.Dense(3)(hidden))
        model = model_class(inputs=inputs, outputs=outputs, **kwargs)
        kernel = model.get_layer("hidden").kernel
        temperature = model.get_layer("held").temperature

        def loss(y_true, y_pred):
            squared = keras.ops.square(y_true - y_pred)
            if reads == "temperature":
                return keras.ops.mean(squared / temperature, axis=-1) + (
                    0.1 * keras.ops.log(temperature))
            return keras.ops.mean(squared, axis=-1) + 0.01 * keras.ops.sum(
                keras.ops.square(kernel))

        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return model

    x, y = regression_data(samples=64)
    plain = build(keras.Model)
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with (strategy.scope() if strategy else contextlib.nullcontext()):
        model = build(AccumulatingModel, n_gradients=4)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert iterations(model) == iterations(plain) == 4
    assert max_weight_difference(plain, model) <= TOLERANCE


@tensorflow_only("Keras's own step under a MirroredStrategy")
@pytest.mark.parametrize("case", ["ignore_class", "clipnorm"])
def test_windows_of_one_under_two_replicas_match_one_device(case,
                                                            two_replicas):
    # n_gradients=1 trains with Keras's own step on one device; under
    # several replicas that step strays from the one-device large batch
    # (it averages the replicas' own means of an `ignore_class` loss, and
    # clips each replica's share), so the model keeps windows of one.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    labels = rng.integers(0, 4, size=(64,)).astype("int32")
    labels[:20] = 0  # ignored: the replicas' shares differ in valid labels
    if case == "ignore_class":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                          ignore_class=0)
        fit_kwargs = {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5, 3: 1.0}}
        make_optimizer = lambda: keras.optimizers.SGD(0.5)  # noqa: E731
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        fit_kwargs = {}
        make_optimizer = lambda: keras.optimizers.SGD(  # noqa: E731
            0.5, clipnorm=0.05)

    def build(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        hidden = keras.layers.LayerNormalization()(hidden)
        return model_class(inputs, keras.layers.Dense(4)(hidden), **kwargs)

    plain, model = fit_both(build, make_optimizer, x, labels, micro_batch=8,
                            n_gradients=1, loss=loss, fit_kwargs=fit_kwargs,
                            strategy=two_replicas)
    assert iterations(model) == iterations(plain) == 16
    assert max_weight_difference(plain, model) <= TOLERANCE
