"""A user's own `train_step` or `compute_loss` accumulates exactly, or is told."""

import contextlib
import warnings

import numpy as np
import pytest

from accum_model import AccumulatingModel
from backends import ON_JAX
from backends import ON_KERAS_2
from backends import ON_TENSORFLOW
from backends import ON_TORCH
from backends import jax_only
from backends import keras_2_too
from backends import keras_3_only
from backends import tensorflow_only
from helpers import iterations
from helpers import keras
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data


if ON_TENSORFLOW:
    import tensorflow as tf
elif ON_TORCH:
    import torch
else:
    import jax
    import jax.numpy as jnp

pytestmark = keras_2_too

# The steps below are TensorFlow's (a tape, stateful variables); JAX's
# stateless step is at the end.
tensorflow_step = tensorflow_only("a stateful step with a GradientTape")


class TapeStep(AccumulatingModel):
    """A functional model whose own step takes its gradients with a tape."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            predictions = self(x, training=True)
            loss = tf.reduce_mean(tf.square(predictions - y))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.accumulate_gradients(gradients, weight=tf.size(y),
                                  batch_size=tf.shape(x)[0])
        return {"loss": loss}


class KerasLossStep(AccumulatingModel):
    """The documented step: a `keras.losses` object, which Keras divides by
    the replicas under a strategy."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, self(x, training=True))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.accumulate_gradients(gradients, weight=tf.shape(x)[0],
                                  batch_size=tf.shape(x)[0])
        return {"loss": loss}


class ComputeLossStep(AccumulatingModel):
    """A step whose loss is the compiled one, through `compute_loss`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.accumulate_gradients(gradients, weight=tf.size(y),
                                  batch_size=tf.shape(x)[0])
        return {"loss": loss}


class ApplyingStep(AccumulatingModel):
    """The pattern that silently stops accumulating."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"loss": loss}


def _fit_without_warnings(model, x, y):
    """Two epochs of micro-batches of 8; any warning (the step bypassing
    the window, say) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*shuffle.*")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)


def _plain_large_batch(x, y, batch, make_optimizer, epochs):
    plain = mlp(keras.Model)
    plain.compile(optimizer=make_optimizer(), loss="mse")
    plain.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return plain


@tensorflow_step
@pytest.mark.parametrize("n_gradients", [4, 1])
@pytest.mark.parametrize("step_class", [TapeStep, KerasLossStep,
                                        ComputeLossStep])
@pytest.mark.parametrize("replicas", [1, 2])
def test_gradient_tape_step_matches_large_batch(replicas, step_class,
                                                n_gradients, two_replicas):
    # Keras's losses (and so `compute_loss`) divide by the replicas under a
    # strategy, `tf.reduce_mean` does not: the window takes both as this
    # replica's own mean. A window of 1 is a step of its own too.
    x, y = regression_data(samples=96)
    plain = _plain_large_batch(x, y, 8 * n_gradients,
                               lambda: keras.optimizers.SGD(0.1), epochs=2)
    strategy = two_replicas if replicas == 2 else tf.distribute.get_strategy()
    with strategy.scope():
        model = mlp(step_class, n_gradients=n_gradients)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.set_weights(mlp(keras.Model).get_weights())
    if ON_KERAS_2 and replicas == 2 and step_class is KerasLossStep:
        # Keras 2 refuses a mean-reduced loss object under a strategy.
        with pytest.raises(ValueError, match="Reduction.SUM"):
            model.fit(x, y, batch_size=8, verbose=0)
        return
    _fit_without_warnings(model, x, y)
    assert iterations(model) == iterations(plain) == 24 // n_gradients
    assert max_weight_difference(plain, model) <= 1e-5


@tensorflow_step
def test_step_that_applies_the_optimizer_itself_is_warned_about():
    x, y = regression_data(samples=32)
    model = mlp(ApplyingStep, n_gradients=4)
    model.compile(optimizer="sgd")
    with pytest.warns(UserWarning, match="accumulate_gradients"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


@tensorflow_step
@keras_3_only("Keras 2 names SpectralNormalization under any step "
              "(test_exactness.py)")
def test_spectral_normalization_under_an_own_step_is_named():
    # The built-in step renormalizes once per window; a step of the user's
    # own runs the forward pass where the window cannot see it, and the
    # layer renormalizes in every micro step.
    x, y = regression_data(samples=32)
    inputs = keras.Input((6,))
    hidden = keras.layers.SpectralNormalization(keras.layers.Dense(8),
                                                name="spectral")(inputs)
    model = TapeStep(inputs=inputs, outputs=keras.layers.Dense(3)(hidden),
                     n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len([w for w in caught if "['spectral']" in str(w.message)]) == 1


@tensorflow_step
def test_step_that_calls_super_is_not_warned_about():
    class Logged(AccumulatingModel):
        def train_step(self, data):
            logs = super().train_step(data)
            return {**logs, "extra": tf.constant(1.0)}

    x, y = regression_data(samples=32)
    model = mlp(Logged, n_gradients=4)
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert iterations(model) == 1


PADDING = -100.0


def _per_sample_mean_loss(y, y_pred):
    """A CTC-like loss: mean over each sample's valid steps, then samples."""
    valid = tf.cast(y > PADDING / 2, y_pred.dtype)
    squared = tf.square(y_pred[..., 0] - y) * valid
    per_sample = tf.reduce_sum(squared, axis=1) / tf.reduce_sum(valid, axis=1)
    return tf.reduce_mean(per_sample)


class PerSampleLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        return _per_sample_mean_loss(y, y_pred)


class AccumulatingPerSampleLoss(AccumulatingModel, PerSampleLoss):
    pass


class StatedWeight(AccumulatingPerSampleLoss):
    def micro_batch_weight(self, x, y, y_pred, sample_weight):
        return tf.cast(tf.shape(x)[0], tf.float32)


def _padded_sequences(samples=64, seed=0):
    """Sequences of 2 to 12 steps, each batch padded to its own longest."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 13, size=samples)
    xs = [rng.normal(size=(n, 3)).astype("float32") for n in lengths]
    ys = [np.tanh(s.sum(axis=1)).astype("float32") for s in xs]
    return xs, ys


def _pad(xs, ys, indices):
    longest = max(len(xs[i]) for i in indices)
    x = np.zeros((len(indices), longest, 3), "float32")
    y = np.full((len(indices), longest), PADDING, "float32")
    for row, i in enumerate(indices):
        x[row, :len(xs[i])] = xs[i]
        y[row, :len(ys[i])] = ys[i]
    return x, y


def _sequence_model(model_class, **kwargs):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((None, 3))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


@tensorflow_step
@pytest.mark.parametrize("model_class", [AccumulatingPerSampleLoss,
                                         StatedWeight])
def test_overridden_compute_loss_is_weighted_by_samples(model_class):
    xs, ys = _padded_sequences()
    micro = [list(range(i, i + 8)) for i in range(0, 64, 8)]
    plain = _sequence_model(PerSampleLoss)
    plain.compile(optimizer=keras.optimizers.SGD(0.1))
    for start in (0, 4):
        plain.train_on_batch(*_pad(xs, ys, sum(micro[start:start + 4], [])))

    model = _sequence_model(model_class, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    data = tf.data.Dataset.from_generator(
        lambda: (_pad(xs, ys, batch) for batch in micro),
        output_signature=(tf.TensorSpec((None, None, 3)),
                          tf.TensorSpec((None, None))),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=1, verbose=0)
    told = [w for w in caught if "micro_batch_weight" in str(w.message)]
    assert len(told) == (1 if model_class is AccumulatingPerSampleLoss else 0)
    assert iterations(model) == 2
    assert max_weight_difference(plain, model) <= 1e-6


class StatelessStep(AccumulatingModel):
    """A JAX step of one's own: pure, `(state, data) -> (logs, state)`."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics_values = state
        x, y = data

        def loss_of(trainable):
            predictions, new_non_trainable = self.stateless_call(
                trainable, non_trainable, x, training=True)
            return jnp.mean(jnp.square(predictions - y)), new_non_trainable

        (loss, non_trainable), gradients = jax.value_and_grad(
            loss_of, has_aux=True)(trainable)
        trainable, optimizer_values = self.stateless_accumulate_gradients(
            optimizer_values, gradients, trainable, weight=jnp.size(y))
        return {"loss": loss}, (trainable, non_trainable, optimizer_values,
                                metrics_values)


@jax_only("a stateless train_step")
@pytest.mark.parametrize("n_gradients", [4, 1])
@pytest.mark.parametrize("devices", [1, 2])
def test_stateless_step_matches_large_batch(devices, n_gradients,
                                            two_replicas):
    # 100 samples: the last micro-batch has 4, the last window 1 of them.
    x, y = regression_data(samples=100)
    plain = _plain_large_batch(x, y, 8 * n_gradients,
                               lambda: keras.optimizers.Adam(0.01), epochs=2)
    scope = two_replicas.scope() if devices == 2 else contextlib.nullcontext()
    with scope:
        model = mlp(StatelessStep, n_gradients=n_gradients)
        model.compile(optimizer=keras.optimizers.Adam(0.01))
        model.set_weights(mlp(keras.Model).get_weights())
        _fit_without_warnings(model, x, y)
    assert iterations(model) == iterations(plain) == (
        8 if n_gradients == 4 else 26)
    assert max_weight_difference(plain, model) <= 1e-5


class TorchStep(AccumulatingModel):
    """A functional model whose own step is PyTorch's: `loss.backward()`,
    then the window where Keras's step calls `optimizer.apply`."""

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = torch.mean(torch.square(self(x, training=True) - y))
        loss.backward()
        gradients = [v.value.grad for v in self.trainable_variables]
        self.accumulate_gradients(gradients, weight=y.numel(),
                                  batch_size=y.shape[0])
        return {"loss": loss.detach()}


@pytest.mark.skipif(not ON_TORCH, reason="PyTorch backend only: a step "
                    "with loss.backward()")
@pytest.mark.parametrize("n_gradients", [4, 1])
def test_torch_step_matches_large_batch(n_gradients):
    # 100 samples: the last micro-batch has 4, the last window 1 of them.
    x, y = regression_data(samples=100)
    plain = _plain_large_batch(x, y, 8 * n_gradients,
                               lambda: keras.optimizers.Adam(0.01), epochs=2)
    model = mlp(TorchStep, n_gradients=n_gradients)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    model.set_weights(mlp(keras.Model).get_weights())
    _fit_without_warnings(model, x, y)
    assert iterations(model) == iterations(plain) == (
        8 if n_gradients == 4 else 26)
    assert max_weight_difference(plain, model) <= 1e-5


def test_each_backend_names_its_own_hook():
    x, y = regression_data(samples=16)
    if not ON_JAX:
        with pytest.raises(NotImplementedError,
                           match="self.accumulate_gradients"):
            mlp(AccumulatingModel, n_gradients=2).\
                stateless_accumulate_gradients([], [], [], 1.0)
        return

    class StatefulStep(AccumulatingModel):
        def train_step(self, state, data):
            self.accumulate_gradients([], weight=1.0)

    model = mlp(StatefulStep, n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(NotImplementedError,
                       match="stateless_accumulate_gradients"):
        model.fit(x, y, batch_size=8, verbose=0)
