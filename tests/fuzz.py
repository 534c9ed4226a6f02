"""A differential fuzzer: generated uses of `AccumulatingModel` against
plain Keras's large batch, each exact or warned.

A `Use` is a plain description (an architecture, a loss, sample or class
weights, an optimizer with its clipping, schedule and EMA, a precision, a
window and a micro-batch size (and a size each batch is split into inside
the step, `micro_batch_size`), a number of samples that leaves a short last
micro-batch, epochs and validation, a seed, one or two replicas, how the
micro-batches reach `fit()`, and whether the run is saved in the middle of
the epoch and resumed from the file); `uses()` draws them
with Hypothesis, which shrinks a failing one to a minimal one. `run(use)`
trains, from the same weights and on one device:

* plain Keras on batches of `n_gradients * micro_batch` (the reference),
* the same with each batch's samples reversed, and shuffled twice (the
  float32 floor: the same training in exact arithmetic), only as far as
  the accumulating model's difference needs a floor above float32's
  epsilon times the largest weight; under mixed precision, the reference
  in float32 too (how far the precision itself moves it),
* an `AccumulatingModel` on micro-batches of `micro_batch`,

and says whether the accumulating model landed within `FLOOR_FACTOR` times
the floor, and whether it warned (or refused) where plain Keras did not.
A use passes when it is exact or warned: a quiet difference is a defect.

`check(use)` runs `compare_with_large_batch`, the check users run, on a
use as it can train it (`checked_use`), beside `run`: the two must agree.

`reproduction(use, outcome)` is a script that runs the use again.
`python tests/fuzz.py N [FIRST_SEED]` runs the N uses `random_use` draws
from seeds FIRST_SEED onwards and prints the counts (the long mode; see
CONTRIBUTING.md).
"""

import contextlib
import dataclasses
import os
import random
import sys
import warnings

import numpy as np

if __name__ == "__main__":
    # Two devices for the uses with two replicas, set up as
    # tests/conftest.py sets them up for the suite, before the backend
    # starts.
    if os.environ.get("KERAS_BACKEND") == "jax":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                   "--xla_force_host_platform_device_count=2")
    elif os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        import tensorflow as tf

        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * 2)

from accum_model import AccumulatingModel
from accum_model._chooser import KERAS_MAJOR
from accum_model._chooser import adapter
from accum_model._chooser import keras
from accum_model.large_batch_check import _skipped_a_step
from helpers import AfterMicroBatch

FLOOR_FACTOR = 10.0
# Under mixed precision, how many times the large batch's own distance from
# float32 a use may land from it. The micro-batches' gradients round to
# bfloat16 apart and then add: an Embedding under SGD landed 2.04 and 2.2
# times that distance away (keras 3.15.1 on torch); a skipped window, or a
# gradient scaled twice, lands orders away.
PRECISION_FACTOR = 4.0

# Architectures: a builder of (inputs, outputs) and the task its output
# serves ("regression": 3 real values; "classification": 4 logits).
# (Dropout and other random layers are not drawn: their numbers differ
# with the batching, so no run is comparable weight for weight.)
ARCHITECTURES = {
    "dense": "regression",
    "two_dense_shared": "regression",
    "frozen_dense": "regression",
    "conv1d": "regression",
    "gru": "regression",
    "lstm": "regression",
    "attention": "regression",
    "layer_normalization": "regression",
    "batch_normalization": "regression",
    "kernel_regularized": "regression",
    "activity_regularized": "regression",
    "add_loss_layer": "regression",
    "two_inputs": "regression",
    "two_outputs": "two_outputs",
    "embedding": "classification",
    "embedding_masked_gru": "classification",
}
LOSSES = {
    "regression": ("mse", "mae", "huber", "log_cosh", "sum_reduction",
                   "per_sample_own", "scalar_mean_own"),
    "classification": ("sparse_logits", "sparse_ignore_class",
                       "categorical_logits"),
    "two_outputs": ("mse_and_mae", "mse_and_huber_weighted"),
}
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
RESUMES = ("none", "weights_file", "keras_file")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw", "rmsprop", "adagrad",
              "nadam", "adamax")
# Optimizers whose update is linear in the gradient: plain Keras's large
# batch applies an Embedding's sparse rows whole with them.
_LINEAR_OPTIMIZERS = ("sgd", "sgd_momentum")
# Losses whose per-sample gradients are equal-sized away from a kink.
_PIECEWISE_LINEAR_LOSSES = ("mae", "huber", "mse_and_mae",
                            "mse_and_huber_weighted")
CLIPPINGS = ("none", "clipnorm", "global_clipnorm", "clipvalue")
SAMPLE_WEIGHTS = ("none", "positive", "with_zeros")
# `fit(class_weight=...)`, drawn for classification on arrays.
CLASS_WEIGHTS = "class_weight"
_FEATURES = 6
_STEPS = 5
_VOCABULARY = 9


@dataclasses.dataclass(frozen=True)
class Use:
    """One generated use; every field is a plain value (see the module)."""

    architecture: str
    loss: str
    optimizer: str
    clipping: str
    sample_weights: str
    n_gradients: int
    micro_batch: int
    samples: int
    seed: int
    replicas: int = 1
    data: str = "arrays"
    precision: str = "float32"
    schedule: bool = False
    ema: bool = False
    epochs: int = 1
    validation: bool = False
    # "none", or how the model is saved after `resume_after` micro-batches
    # and loaded to train the rest.
    resume: str = "none"
    resume_after: int = 0
    # The accumulating model's `micro_batch_size` (0: None): each of its
    # batches of `micro_batch` is split into micro-batches of this size
    # inside the step (a replica's share, under two).
    split: int = 0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `run` found: `exact` (the weights and the logged losses within
    their floors), `warned` (messages the accumulating model gave that
    plain Keras did not), `refused` (the error it raised before training,
    or ""), and the figures."""

    exact: bool
    warned: tuple
    refused: str
    difference: float
    floor: float
    loss_difference: float = 0.0
    loss_floor: float = 0.0
    # Plain Keras's error on the large batch, or "": no reference.
    plain_failed: str = ""

    @property
    def passes(self):
        return (self.exact or bool(self.warned) or bool(self.refused)
                or bool(self.plain_failed))

    @property
    def warned_but_exact(self):
        return self.exact and bool(self.warned)


def data_kinds():
    """How the accumulating model's micro-batches reach `fit()` here:
    arrays, a Python generator, a `PyDataset` (Keras 3) and a `tf.data`
    dataset (on TensorFlow)."""
    kinds = ["arrays", "generator"]
    if KERAS_MAJOR == 3:
        kinds.append("py_dataset")
    if keras.backend.backend() == "tensorflow":
        kinds.append("tf_data")
    return tuple(kinds)


def uses():
    """A Hypothesis strategy of `Use`s (it shrinks a failing one)."""
    from hypothesis import strategies as st

    class Picks:
        def __init__(self, draw):
            self._draw = draw

        def one_of(self, values):
            return self._draw(st.sampled_from(values))

        def integer(self, low, high):
            return self._draw(st.integers(low, high))

        def boolean(self):
            return self._draw(st.booleans())

    return st.composite(lambda draw: _drawn_use(Picks(draw)))()


def random_use(seed):
    """The `Use` drawn from `seed` on its own: every value uniformly, each
    use independent of the others (Hypothesis's search draws its next use
    near the ones before it)."""

    class Picks:
        def __init__(self):
            self._random = random.Random(seed)

        def one_of(self, values):
            return self._random.choice(tuple(values))

        def integer(self, low, high):
            return self._random.randint(low, high)

        def boolean(self):
            return self._random.random() < 0.5

    return _drawn_use(Picks())


def _drawn_use(picks):
    """A `Use` of values from `picks` (`one_of(values)`, `integer(low,
    high)`, `boolean()`), within what can be compared with plain Keras
    here."""
    architecture = picks.one_of(sorted(ARCHITECTURES))
    task = ARCHITECTURES[architecture]
    optimizers, clippings = OPTIMIZERS, CLIPPINGS
    # Plain Keras's own strays on an Embedding's repeated sparse rows,
    # named in docs/exactness.md (the window equals the large batch given
    # densely).
    if "embedding" in architecture:
        if "optimizer" in adapter.SPARSE_ROW_STRAYS:
            optimizers = _LINEAR_OPTIMIZERS
        if "clipping" in adapter.SPARSE_ROW_STRAYS:
            clippings = ("none",)
    n_gradients = picks.integer(1, 4)
    replicas = picks.one_of(
        (1, 2) if two_replicas() is not None else (1,))
    # Each replica gets an equal share of every micro-batch.
    micro_batch = replicas * picks.integer(1, 6 // replicas)
    large = n_gradients * micro_batch
    # Up to _STEPS windows, the last of any length (a short last
    # micro-batch, a short last window).
    samples = replicas * picks.integer(
        large // replicas, _STEPS * large // replicas)
    micro_batches = -(-samples // micro_batch)
    resumes = [name for name in RESUMES
               if name != "keras_file" or KERAS_MAJOR == 3]
    resume = (picks.one_of(resumes) if micro_batches > 1
              else "none")
    precisions = PRECISIONS
    if architecture == "attention" and keras.backend.backend() == "jax":
        # "The precision 'F16_F16_F32' is not supported by dot_general
        # on CPU" (jax 0.10.2), plain Keras as well.
        precisions = ("float32", "mixed_bfloat16")
    if (architecture == "activity_regularized" and KERAS_MAJOR == 3
            and keras.backend.backend() == "tensorflow"):
        # Keras 3.15.1 on TensorFlow cannot add an activity penalty
        # computed in 16 bits to its float32 loss, plain Keras alike.
        precisions = ("float32",)
    precision = picks.one_of(precisions)
    if precision == "mixed_bfloat16":
        # A micro-batch's gradient leaves its backward pass rounded to
        # bfloat16 before the window adds it in float32, where the
        # large batch rounds the sum once: micro-batch gradients that
        # cancel keep 2**-9 of their own size, and Adam's normalization
        # turns that into steps of the learning rate (1.4e-2 where
        # plain Keras lands 8e-4 from float32, two outputs under Adam,
        # keras 3.15.1 on torch). Gradients that enter the update
        # linearly keep it at rounding's size.
        optimizers = _LINEAR_OPTIMIZERS
    if resume != "none" and precision == "mixed_float16":
        # Keras's LossScaleOptimizer saves no Nadam `_u_product`: plain
        # Keras resumes Nadam with it at 1.0 on TensorFlow and PyTorch
        # (keras 3.15.1; docs/exactness.md).
        optimizers = tuple(name for name in optimizers
                           if name != "nadam")
    kinds = data_kinds()
    if KERAS_MAJOR == 2 and n_gradients == 1:
        # Windows of one are Keras 2's own step, which at the end of a
        # Python generator counts an update without data (named in
        # docs/exactness.md; test_keras2.py holds the window to the large
        # batch there).
        kinds = tuple(kind for kind in kinds if kind != "generator")
    weights = SAMPLE_WEIGHTS + (
        (CLASS_WEIGHTS,) if task == "classification" else ())
    sample_weights = picks.one_of(weights)
    if resume != "none" or sample_weights == CLASS_WEIGHTS:
        kinds = ("arrays",)
    data = picks.one_of(kinds)
    loss = picks.one_of(LOSSES[task])
    if precision == "mixed_float16" and loss in _PIECEWISE_LINEAR_LOSSES:
        # The same under float16 (2**-12 of their size) where the terms
        # cancel exactly: a piecewise-linear loss's equal-sized terms. An
        # output bias whose 18 MAE terms cancel stayed at 0 under plain
        # Keras, and took an Adam step of 6.2e-3 from the 1.5e-5 that
        # three-term sums rounded to float16 left (tf_keras 2.21, two
        # replicas; docs/exactness.md).
        optimizers = _LINEAR_OPTIMIZERS
    use = Use(
        data=data,
        architecture=architecture,
        loss=loss,
        optimizer=picks.one_of(optimizers),
        clipping=picks.one_of(clippings),
        sample_weights=sample_weights,
        n_gradients=n_gradients,
        micro_batch=micro_batch,
        samples=samples,
        seed=picks.integer(0, 2**16),
        replicas=replicas,
        precision=precision,
        schedule=picks.boolean(),
        ema=picks.boolean(),
        # A resumed run is one epoch, saved in it and trained to its end.
        epochs=(1 if resume != "none"
                else picks.integer(1, 2)),
        validation=resume == "none" and picks.boolean(),
        resume=resume,
        resume_after=(0 if resume == "none" else picks.integer(
            1, micro_batches - 1)),
    )
    # Drawn last, so that a seed draws the rest as it did before.
    return dataclasses.replace(use, split=picks.integer(0, 3))


def two_replicas():
    """The suite's distribution over two devices (one a process, see
    `backends.two_replicas_distribution`), or None where there is none."""
    from backends import two_replicas_distribution

    distribution = two_replicas_distribution()
    return None if isinstance(distribution, str) else distribution


def _ops():
    return keras.ops if KERAS_MAJOR == 3 else keras.backend


class _MeanActivityPenalty(keras.layers.Layer):
    """Passes its input through and adds 0.01 times its mean square, a
    layer's own `add_loss` term that is a mean over the batch."""

    def call(self, inputs):
        # In float32, as Keras adds losses (a float16 term cannot join the
        # float32 loss on TensorFlow).
        inputs_32 = _ops().cast(inputs, "float32")
        self.add_loss(0.01 * _ops().mean(_ops().square(inputs_32)))
        return inputs


def _model(use, model_class, **kwargs):
    keras.utils.set_random_seed(use.seed)
    layers = keras.layers
    task = ARCHITECTURES[use.architecture]
    sequences = ("conv1d", "gru", "lstm", "attention")
    if "embedding" in use.architecture:
        inputs = keras.Input((5,), dtype="int32")
        masked = use.architecture == "embedding_masked_gru"
        hidden = layers.Embedding(_VOCABULARY, 8, mask_zero=masked)(inputs)
        hidden = (layers.GRU(8)(hidden) if masked
                  else layers.GlobalAveragePooling1D()(hidden))
    elif use.architecture in sequences:
        inputs = keras.Input((5, _FEATURES))
        if use.architecture == "conv1d":
            hidden = layers.Conv1D(8, 3, activation="relu")(inputs)
        elif use.architecture == "attention":
            # No biases: a key bias shifts every score of a query alike, so
            # its gradient is zero in exact arithmetic and Adam-like
            # optimizers step on its rounding, which any change of
            # grouping moves (1.5e-3 from one device under `DataParallel`,
            # plain Keras alike, in float64; keras 3.15.1 on JAX).
            hidden = layers.MultiHeadAttention(2, 4, use_bias=False)(
                inputs, inputs)
        else:
            recurrent = (layers.GRU if use.architecture == "gru"
                         else layers.LSTM)
            hidden = recurrent(8, return_sequences=True)(inputs)
        hidden = layers.GlobalAveragePooling1D()(hidden)
    else:
        inputs = keras.Input((_FEATURES,))
        hidden = inputs
        if use.architecture == "two_inputs":
            inputs = [inputs, keras.Input((2,))]
            hidden = layers.Concatenate()(inputs)
        elif use.architecture == "batch_normalization":
            hidden = layers.BatchNormalization()(hidden)
        regularizer = (keras.regularizers.L2(0.01)
                       if use.architecture == "kernel_regularized" else None)
        activity = (keras.regularizers.L2(0.01)
                    if use.architecture == "activity_regularized" else None)
        first = layers.Dense(16, activation="tanh",
                             kernel_regularizer=regularizer,
                             activity_regularizer=activity)
        hidden = first(hidden)
        if use.architecture == "two_dense_shared":
            shared = layers.Dense(16, activation="tanh")
            hidden = shared(shared(hidden))
        elif use.architecture == "frozen_dense":
            frozen = layers.Dense(16, activation="tanh")
            hidden = frozen(hidden)
            frozen.trainable = False
        elif use.architecture == "layer_normalization":
            hidden = layers.LayerNormalization()(hidden)
        elif use.architecture == "add_loss_layer":
            hidden = _MeanActivityPenalty()(hidden)
    if task == "two_outputs":
        outputs = [layers.Dense(3)(hidden), layers.Dense(2)(hidden)]
    else:
        outputs = layers.Dense(3 if task == "regression" else 4)(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def _per_sample_own(y_true, y_pred):
    ops = _ops()
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


def _scalar_mean_own(y_true, y_pred):
    ops = _ops()
    return ops.mean(ops.square(y_true - y_pred))


def _loss(use):
    losses = keras.losses
    return {
        "mse": lambda: "mse", "mae": lambda: "mae", "huber": lambda: "huber",
        "log_cosh": lambda: "log_cosh",
        "sum_reduction": lambda: losses.MeanSquaredError(reduction="sum"),
        "per_sample_own": lambda: _per_sample_own,
        "scalar_mean_own": lambda: _scalar_mean_own,
        "sparse_logits": lambda: losses.SparseCategoricalCrossentropy(
            from_logits=True),
        "sparse_ignore_class": lambda: losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=0),
        "categorical_logits": lambda: losses.CategoricalCrossentropy(
            from_logits=True),
        "mse_and_mae": lambda: ["mse", "mae"],
        "mse_and_huber_weighted": lambda: ["mse", "huber"],
    }[use.loss]()


_CUSTOM_OBJECTS = {"_MeanActivityPenalty": _MeanActivityPenalty,
                   "_per_sample_own": _per_sample_own,
                   "_scalar_mean_own": _scalar_mean_own}


def _loss_weights(use):
    return [1.0, 0.5] if use.loss == "mse_and_huber_weighted" else None


def _optimizer(use):
    optimizers = keras.optimizers
    options = {"none": {}, "clipnorm": {"clipnorm": 0.1},
               "global_clipnorm": {"global_clipnorm": 0.1},
               "clipvalue": {"clipvalue": 0.05}}[use.clipping]
    if use.ema:
        options.update(use_ema=True, ema_momentum=0.8)

    def rate(initial):
        if not use.schedule:
            return initial
        return optimizers.schedules.ExponentialDecay(initial, decay_steps=2,
                                                     decay_rate=0.6)

    make = {
        "sgd": lambda: optimizers.SGD(rate(0.05), **options),
        "sgd_momentum": lambda: optimizers.SGD(rate(0.05), momentum=0.9,
                                               **options),
        "adam": lambda: optimizers.Adam(rate(0.01), **options),
        "adamw": lambda: optimizers.AdamW(rate(0.01), weight_decay=0.01,
                                          **options),
        "rmsprop": lambda: optimizers.RMSprop(rate(0.01), **options),
        "adagrad": lambda: optimizers.Adagrad(rate(0.05), **options),
        "nadam": lambda: optimizers.Nadam(rate(0.01), **options),
        "adamax": lambda: optimizers.Adamax(rate(0.01), **options),
    }[use.optimizer]
    return make()


def _data(use):
    """(x, y, sample weights or None, class weights or None); x and y are
    lists for models of two inputs or outputs."""
    rng = np.random.default_rng(use.seed)
    samples = use.samples
    if "embedding" in use.architecture:
        x = rng.integers(1, _VOCABULARY, size=(samples, 5)).astype("int32")
        x[rng.random(samples) < 0.3, 3:] = 0  # padding
    elif use.architecture in ("conv1d", "gru", "lstm", "attention"):
        x = rng.normal(size=(samples, 5, _FEATURES)).astype("float32")
    else:
        x = rng.normal(size=(samples, _FEATURES)).astype("float32")
    if use.architecture == "two_inputs":
        x = [x, rng.normal(size=(samples, 2)).astype("float32")]
    task = ARCHITECTURES[use.architecture]
    if task == "regression":
        y = rng.normal(size=(samples, 3)).astype("float32")
    elif task == "two_outputs":
        y = [rng.normal(size=(samples, width)).astype("float32")
             for width in (3, 2)]
    else:
        y = rng.integers(0, 4, size=(samples,)).astype("int32")
        if use.loss == "categorical_logits":
            y = np.eye(4, dtype="float32")[y]
    weights = {"none": None, CLASS_WEIGHTS: None,
               "positive": rng.uniform(0.5, 2.0, samples),
               "with_zeros": rng.uniform(0.5, 2.0, samples)
               * (rng.random(samples) < 0.7)}[use.sample_weights]
    if weights is not None:
        weights = weights.astype("float32")
    class_weight = ({0: 0.5, 1: 1.0, 2: 2.0, 3: 1.5}
                    if use.sample_weights == CLASS_WEIGHTS else None)
    return x, y, weights, class_weight


def _rows(structure, rows):
    """`structure` (an array, a list of them, or None) at `rows`."""
    if structure is None:
        return None
    if isinstance(structure, list):
        return [part[rows] for part in structure]
    return structure[rows]


@contextlib.contextmanager
def _precision(use):
    # float64 losses too: Keras computes a loss in `floatx()`, and a float32
    # mean in a float64 model is 1e-7 from the float64 gradient.
    keras.mixed_precision.set_global_policy(use.precision)
    keras.backend.set_floatx(
        "float64" if use.precision == "float64" else "float32")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.set_floatx("float32")


def _compiled(use, model):
    """`model` compiled with `use`'s optimizer, loss and loss weights."""
    model.compile(optimizer=_optimizer(use), loss=_loss(use),
                  loss_weights=_loss_weights(use))
    return model


def run(use):
    """Trains `use` three ways (see the module) and returns an `Outcome`."""
    with _precision(use):
        return _run(use)


def _run(use):
    x, y, sample_weight, class_weight = _data(use)
    large_batch = use.n_gradients * use.micro_batch
    start = _model(use, keras.Model).get_weights()
    validation = (_rows(x, slice(0, 8)), _rows(y, slice(0, 8)))

    def compiled(model):
        return _compiled(use, model)

    def fit(model, batch_size, order, data="arrays", callbacks=(),
            first=0):
        """Trains `model` from the start weights on the samples `order`
        from `first` on; returns (weights, History's record, messages)."""
        if first == 0:
            model.set_weights(start)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if first == 0:
                compiled(model)
            keras.utils.set_random_seed(use.seed)
            order = order[first:]
            arrays = (_rows(x, order), _rows(y, order),
                      _rows(sample_weight, order))
            # Validation in one batch: fit() otherwise takes its batch size
            # from the training batches', or 32 for a dataset, and a
            # summed loss's mean over batches depends on it.
            options = dict(epochs=use.epochs, shuffle=False, verbose=0,
                           callbacks=list(callbacks),
                           validation_data=(validation if use.validation
                                            else None),
                           validation_batch_size=8)
            if data == "arrays":
                history = model.fit(*arrays[:2], batch_size=batch_size,
                                    sample_weight=arrays[2],
                                    class_weight=class_weight, **options)
            elif data == "generator" and use.epochs > 1:
                # A generator runs once: for several epochs it runs through
                # the data once an epoch, and fit() is told the epoch's
                # length, as one does with a generator that never ends.
                history = model.fit(
                    _batches(arrays, batch_size, data, use.epochs),
                    steps_per_epoch=-(-len(order) // batch_size), **options)
            else:
                history = model.fit(_batches(arrays, batch_size, data),
                                    **options)
        # The library's warnings point at the line that called it (here);
        # Keras's own about the data (a generator that ran out) point
        # into Keras.
        messages = [str(w.message) for w in caught
                    if issubclass(w.category, UserWarning)
                    and not _inside_a_library(w.filename)]
        return model.get_weights(), history.history, messages

    in_order = np.arange(use.samples)
    try:
        plain = _model(use, keras.Model)
        reference, plain_record, plain_messages = fit(plain, large_batch,
                                                      in_order)
        # A step the large batch skipped for overflow is no rounding: its
        # float32 twin below skips none.
        reference_skipped = _skipped_a_step(plain)
    except Exception as error:  # noqa: BLE001 - Keras's own, any kind
        # Nothing to compare with (Keras 3.15.1 on TensorFlow cannot add
        # an activity penalty computed in float16 to its float32 loss).
        return Outcome(False, (), "", float("nan"), float("nan"),
                       plain_failed=f"{type(error).__name__}: {error}")
    def accumulate(**settings):
        if use.split:
            settings["micro_batch_size"] = use.split
        with (two_replicas().scope() if use.replicas == 2
              else contextlib.nullcontext()):
            accumulating = _model(use, AccumulatingModel,
                                  n_gradients=use.n_gradients, **settings)
            if use.resume == "none":
                return fit(accumulating, use.micro_batch, in_order, use.data)
            return _interrupted_and_resumed(use, accumulating, compiled, fit,
                                            in_order, **settings)

    try:
        accumulated, record, messages = accumulate()
    except ValueError as error:
        return Outcome(False, (), str(error), float("nan"), float("nan"))
    warned = tuple(dict.fromkeys(m for m in messages
                                 if m not in plain_messages))
    difference = _max_difference(accumulated, reference)
    loss_difference = _loss_difference(record, plain_record)
    largest = max(float(np.max(np.abs(w))) for w in reference if w.size)
    floor = float(np.finfo(np.float32).eps) * largest
    loss_floor = _LOSS_RELATIVE_FLOOR
    # The floor: how far the large batch moves with each batch's samples in
    # other orders (reversed, and two shuffles), trained only while the
    # difference is above the floor so far. One order is not enough where
    # Adam's normalization turns the rounding of a gradient that nearly
    # cancels into a step: 4.2e-7 reversed, up to 5.1e-6 shuffled (AdamW,
    # an Embedding, keras 3.15.1 on torch).
    rng = np.random.default_rng(use.seed)
    for reorder in (lambda batch: batch[::-1], rng.permutation,
                    rng.permutation):
        if (difference <= FLOOR_FACTOR * floor
                and loss_difference <= FLOOR_FACTOR * loss_floor):
            break
        reordered, reordered_record, _ = fit(
            _model(use, keras.Model), large_batch, np.concatenate([
                reorder(in_order[begin:begin + large_batch])
                for begin in range(0, use.samples, large_batch)]))
        floor = max(floor, _max_difference(reordered, reference))
        loss_floor = max(loss_floor,
                         _loss_difference(reordered_record, plain_record))
    exact = (difference <= FLOOR_FACTOR * floor
             and loss_difference <= FLOOR_FACTOR * loss_floor)
    if not exact and use.precision != "float32" and not reference_skipped:
        # float16 and bfloat16 round the large batch's own gradient, which
        # no reordering moves: how far that batch lands from float32's
        # sets the scale, as in tests/test_mixed_precision.py. A gradient
        # scaled twice or left scaled misses it by orders.
        with _precision(dataclasses.replace(use, precision="float32")):
            in_float32, float32_record, _ = fit(_model(use, keras.Model),
                                                large_batch, in_order)
        floor = max(floor, PRECISION_FACTOR / FLOOR_FACTOR
                    * _max_difference(in_float32, reference))
        # Keras 2 computes the loss itself in float16: the large batch's
        # mean and the window's mean of micro-batch means round apart by
        # up to one unit in the last place (0.00098 in 1.33 apart, with
        # TensorFlow 2.21's tf-keras).
        loss_floor = max(loss_floor, PRECISION_FACTOR / FLOOR_FACTOR
                         * _loss_difference(float32_record, plain_record),
                         _LAST_PLACE[use.precision] / FLOOR_FACTOR)
        exact = (difference <= FLOOR_FACTOR * floor
                 and loss_difference <= FLOOR_FACTOR * loss_floor)
    if (not exact and use.precision == "float32"
            and difference <= _ROUNDING_SIZED):
        # Where a gradient nearly cancels, the window's sum of micro-batch
        # sums keeps float32's rounding of each, while plain Keras's large
        # batch sums in one reduction that no reordering moves, and Adam's
        # normalization makes either rounding a step (1.2e-5 against a
        # reordered floor of 6.5e-8: AdamW, MAE, 16 samples, keras 3.15.1
        # on JAX). In float64 both are the same training to 1e-9, or the
        # window's arithmetic is wrong.
        with _precision(dataclasses.replace(use, precision="float64")), \
                _float64_numbers():
            in_float64 = fit(_model(use, keras.Model), large_batch,
                             in_order)[0]
            accumulated_in_float64 = accumulate(accumulator_dtype="float64")[0]
        exact = (_max_difference(accumulated_in_float64, in_float64)
                 <= _FLOAT64_AGREEMENT * max(1.0, largest))
    return Outcome(exact, warned, "", difference, floor, loss_difference,
                   loss_floor)


@contextlib.contextmanager
def _float64_numbers():
    """Where JAX computes in float32 unless told (its 64-bit mode)."""
    if keras.backend.backend() != "jax":
        yield
        return
    import jax

    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


# A float32 difference the float64 check may explain as rounding; a
# micro-batch left out, or weighed wrong, lands further.
_ROUNDING_SIZED = 1e-4
# How far the float64 trainings may land apart.
_FLOAT64_AGREEMENT = 1e-9


# Two float32 means of the same losses summed in other groupings.
_LOSS_RELATIVE_FLOOR = 1e-6
# One unit in the last place, relative, of a number in [1, 2).
_LAST_PLACE = {"mixed_float16": 2.0**-10, "mixed_bfloat16": 2.0**-7}


def _loss_difference(record, reference_record):
    """The largest relative difference of the logged losses (training and
    validation, every epoch); 0 where `record` is a resumed run's."""
    if record is None:
        return 0.0
    return max((abs(a - b) / max(1.0, abs(b))
                for key in ("loss", "val_loss") if key in reference_record
                for a, b in zip(record[key], reference_record[key])),
               default=0.0)


def _interrupted_and_resumed(use, accumulating, compiled, fit, in_order,
                             **settings):
    """Trains the epoch saving after `use.resume_after` micro-batches, then
    a model loaded from that file on the micro-batches after them."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        if use.resume == "keras_file":
            file = os.path.join(directory, "mid.keras")
            save = AfterMicroBatch(use.resume_after, lambda m: m.save(file))
        else:
            file = os.path.join(directory, "mid.weights.h5"
                                if KERAS_MAJOR == 3 else "mid")
            save = AfterMicroBatch(use.resume_after,
                                   lambda m: m.save_weights(file))
        *_, messages = fit(accumulating, use.micro_batch, in_order,
                           callbacks=[save])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if use.resume == "keras_file":
                resumed = keras.models.load_model(
                    file, custom_objects=_CUSTOM_OBJECTS)
            else:
                resumed = compiled(_model(use, AccumulatingModel,
                                          n_gradients=use.n_gradients,
                                          **settings))
                # Keras loads optimizer variables only into a built
                # optimizer.
                resumed.optimizer.build(resumed.trainable_variables)
                resumed.load_weights(file)
        messages += [str(w.message) for w in caught
                     if issubclass(w.category, UserWarning)
                     and not _inside_a_library(w.filename)]
        weights, _, more = fit(resumed, use.micro_batch, in_order,
                               first=use.resume_after * use.micro_batch)
    return weights, None, messages + more


def _inside_a_library(filename):
    return any(f"{os.sep}{name}{os.sep}" in filename
               for name in ("keras", "tf_keras", "tensorflow", "jax"))


def _batches(arrays, batch_size, data, epochs=1):
    """The micro-batches of `arrays` (x, y and sample weights or None) as
    `data` hands them to `fit()`: a Python generator (of unknown length; of
    `epochs` passes through the data), a `PyDataset` or a `tf.data`
    dataset."""
    arrays = tuple(part for part in arrays if part is not None)
    samples = len(arrays[1][0] if isinstance(arrays[1], list) else arrays[1])
    starts = range(0, samples, batch_size)

    def batch(start):
        # Keras takes a generator's inputs and outputs as tuples.
        return tuple(_tuple(_rows(part, slice(start, start + batch_size)))
                     for part in arrays)

    if data == "generator":
        return (batch(start) for _ in range(epochs) for start in starts)
    if data == "tf_data":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(
            tuple(_tuple(part) for part in arrays)).batch(batch_size)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return len(starts)

        def __getitem__(self, index):
            return batch(starts[index])

    return Batches()


def _tuple(structure):
    return tuple(structure) if isinstance(structure, list) else structure


def _max_difference(weights_a, weights_b):
    return max((float(np.max(np.abs(a - b))) for a, b in
                zip(weights_a, weights_b) if a.size), default=0.0)


def reproduction(use, outcome):
    """A script that runs `use` again from the repository's root."""
    return (
        f"accumulation differed quietly: weights by {outcome.difference:.3e}"
        f" against a floor of {outcome.floor:.3e}, the logged loss by "
        f"{outcome.loss_difference:.3e} (relative) against "
        f"{outcome.loss_floor:.3e}, each allowed {FLOOR_FACTOR:g} times "
        "over, with no warning. To run it again, from the repository's "
        "root:\n\n"
        "import sys\n"
        "sys.path.insert(0, 'tests')\n"
        "import fuzz\n"
        f"print(fuzz.run(fuzz.{use!r}))\n")


def _long_run(count, first_seed=0):
    """Runs the uses drawn from seeds `first_seed` to `first_seed + count -
    1` (`random_use`) and prints a line a use, the counts, the warnings
    given where the use was exact, and each quiet difference's
    reproduction."""
    counts = {"uses": 0, "exact": 0, "warned": 0, "warned but exact": 0,
              "refused": 0, "plain Keras failed": 0, "errors": 0,
              "quiet differences": 0}
    failures = []
    noise = {}
    for use_seed in range(first_seed, first_seed + count):
        use = random_use(use_seed)
        counts["uses"] += 1
        try:
            outcome = run(use)
        except Exception as error:  # noqa: BLE001 - reported, run goes on
            counts["errors"] += 1
            failures.append(f"{type(error).__name__}: {error}\n{use!r}")
            print(counts["uses"], use_seed, "error", use, failures[-1],
                  flush=True)
            continue
        counts["exact"] += outcome.exact
        counts["warned"] += bool(outcome.warned)
        counts["warned but exact"] += outcome.warned_but_exact
        if outcome.warned_but_exact:
            for message in outcome.warned:
                noise[message[:120]] = noise.get(message[:120], 0) + 1
        counts["refused"] += bool(outcome.refused)
        counts["plain Keras failed"] += bool(outcome.plain_failed)
        if not outcome.passes:
            counts["quiet differences"] += 1
            failures.append(reproduction(use, outcome))
            print(failures[-1], flush=True)
        # One line a use, so that a run cut short still says what it did.
        print(counts["uses"], use_seed, "quiet difference"
              if not outcome.passes
              else "plain Keras failed" if outcome.plain_failed
              else "refused" if outcome.refused else "warned but exact"
              if outcome.warned_but_exact else "warned" if outcome.warned
              else "exact", use, flush=True)
        if outcome.warned_but_exact:
            # Which warnings fired where nothing was wrong, use by use (a
            # run cut short prints no totals).
            print("    warned:", " | ".join(message[:80] for message
                                          in outcome.warned), flush=True)
    for name, value in counts.items():
        print(f"{name}: {value}")
    for message, times in sorted(noise.items(), key=lambda item: -item[1]):
        print(f"warned where exact, {times} times: {message}")
    for failure in failures:
        print("\n" + failure)


# `compare_with_large_batch` against the fuzzer ---------------------------


def checked_use(use):
    """`use` as `compare_with_large_batch` can train it: arrays, one epoch
    on one device, no class weights (it takes sample weights), no
    validation, saving or split batch."""
    return dataclasses.replace(
        use, data="arrays", epochs=1, validation=False, resume="none",
        resume_after=0, replicas=1, split=0,
        sample_weights=("none" if use.sample_weights == CLASS_WEIGHTS
                        else use.sample_weights))


def check(use):
    """Runs `compare_with_large_batch` on `use` (a `checked_use`) and the
    fuzzer's own three trainings; returns (its `LargeBatchComparison`, the
    fuzzer's `Outcome`). The two agree where the check says "matches"
    exactly where the fuzzer found the training exact."""
    from accum_model import compare_with_large_batch

    with _precision(use):
        x, y, sample_weight, _ = _data(use)
        model = _compiled(use, _model(use, keras.Model))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            comparison = compare_with_large_batch(
                model, x, y, batch_size=use.micro_batch,
                n_gradients=use.n_gradients,
                steps=-(-use.samples // (use.n_gradients * use.micro_batch)),
                sample_weight=sample_weight, seed=use.seed)
    return comparison, run(use)


def _check_run(count, first_seed=0):
    """Runs `check` on the `checked_use`s of the uses drawn from seeds
    `first_seed` on, and prints each disagreement: the check saying
    "matches" where the training differs (a quiet wrong answer of the
    check), or "differs" where it is exact (a false alarm)."""
    counts = {"uses": 0, "agree": 0, "matches where it differs": 0,
              "differs where exact": 0, "no verdict": 0, "errors": 0}
    for use_seed in range(first_seed, first_seed + count):
        use = checked_use(random_use(use_seed))
        counts["uses"] += 1
        try:
            comparison, outcome = check(use)
        except Exception as error:  # noqa: BLE001 - reported, run goes on
            counts["errors"] += 1
            print(counts["uses"], use_seed, "error",
                  f"{type(error).__name__}: {error}", use, flush=True)
            continue
        if (comparison.matches is None or outcome.refused
                or outcome.plain_failed):
            kind = "no verdict"
        elif comparison.matches == outcome.exact:
            kind = "agree"
        elif comparison.matches:
            kind = "matches where it differs"
        else:
            kind = "differs where exact"
        counts[kind] += 1
        print(counts["uses"], use_seed, kind, use, flush=True)
        if kind not in ("agree", "no verdict"):
            print(f"    check: {comparison}\n    fuzzer: {outcome}",
                  flush=True)
    for name, value in counts.items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        _check_run(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3
                   else 0)
    else:
        _long_run(int(sys.argv[1]) if len(sys.argv) > 1 else 100,
                  int(sys.argv[2]) if len(sys.argv) > 2 else 0)
