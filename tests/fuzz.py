"""A differential fuzzer: generated uses of `AccumulatingModel` against
plain Keras's large batch, each exact or warned.

A `Use` is a plain description (an architecture, a loss, sample weights, an
optimizer and its clipping, a window and a micro-batch size, a number of
samples that leaves a short last micro-batch, a seed, one or two replicas,
and how the micro-batches reach `fit()`); `uses()` draws them
with Hypothesis, which shrinks a failing one to a minimal one. `run(use)`
trains, from the same weights and on one device:

* plain Keras on batches of `n_gradients * micro_batch` (the reference),
* the same with each batch's samples reversed, and shuffled twice (the
  float32 floor: the same training in exact arithmetic), only as far as
  the accumulating model's difference needs a floor above float32's
  epsilon times the largest weight,
* an `AccumulatingModel` on micro-batches of `micro_batch`,

and says whether the accumulating model landed within `FLOOR_FACTOR` times
the floor, and whether it warned (or refused) where plain Keras did not.
A use passes when it is exact or warned: a quiet difference is a defect.

`reproduction(use, outcome)` is a script that runs the use again.
`python tests/fuzz.py N` runs N uses drawn from seed 0 and prints the
counts (the long mode; see CONTRIBUTING.md).
"""

import contextlib
import dataclasses
import os
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

FLOOR_FACTOR = 10.0

# Architectures: a builder of (inputs, outputs) and the task its output
# serves ("regression": 3 real values; "classification": 4 logits).
ARCHITECTURES = {
    "dense": "regression",
    "two_dense_shared": "regression",
    "frozen_dense": "regression",
    "conv1d": "regression",
    "gru": "regression",
    "layer_normalization": "regression",
    "kernel_regularized": "regression",
    "embedding": "classification",
    "embedding_masked_gru": "classification",
}
LOSSES = {
    "regression": ("mse", "mae", "huber", "log_cosh", "sum_reduction",
                   "per_sample_own", "scalar_mean_own"),
    "classification": ("sparse_logits", "sparse_ignore_class",
                       "categorical_logits"),
}
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw", "rmsprop", "adagrad",
              "nadam", "adamax")
# Optimizers whose update is linear in the gradient: plain Keras's large
# batch applies an Embedding's sparse rows whole with them.
_LINEAR_OPTIMIZERS = ("sgd", "sgd_momentum")
CLIPPINGS = ("none", "clipnorm", "global_clipnorm", "clipvalue")
SAMPLE_WEIGHTS = ("none", "positive", "with_zeros")
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


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What `run` found: `exact` (within the floor), `warned` (messages the
    accumulating model gave that plain Keras did not), `refused` (the
    error it raised before training, or ""), and the figures."""

    exact: bool
    warned: tuple
    refused: str
    difference: float
    floor: float

    @property
    def passes(self):
        return self.exact or bool(self.warned) or bool(self.refused)

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
    """A Hypothesis strategy of `Use`s."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw_value):
        architecture = draw_value(st.sampled_from(sorted(ARCHITECTURES)))
        task = ARCHITECTURES[architecture]
        optimizers, clippings = OPTIMIZERS, CLIPPINGS
        # Plain Keras's own strays on an Embedding's repeated sparse rows,
        # named in the README (the window equals the large batch given
        # densely).
        if "embedding" in architecture:
            if "optimizer" in adapter.SPARSE_ROW_STRAYS:
                optimizers = _LINEAR_OPTIMIZERS
            if "clipping" in adapter.SPARSE_ROW_STRAYS:
                clippings = ("none",)
        n_gradients = draw_value(st.integers(1, 4))
        replicas = draw_value(st.sampled_from(
            (1, 2) if two_replicas() is not None else (1,)))
        # Each replica gets an equal share of every micro-batch.
        micro_batch = replicas * draw_value(st.integers(1, 6 // replicas))
        large = n_gradients * micro_batch
        kinds = data_kinds()
        if KERAS_MAJOR == 2 and n_gradients == 1:
            # Windows of one are Keras 2's own step, which at the end of a
            # Python generator counts an update without data (named in
            # the README; test_keras2.py holds the window to the large
            # batch there).
            kinds = tuple(kind for kind in kinds if kind != "generator")
        return Use(
            data=draw_value(st.sampled_from(kinds)),
            architecture=architecture,
            loss=draw_value(st.sampled_from(LOSSES[task])),
            optimizer=draw_value(st.sampled_from(optimizers)),
            clipping=draw_value(st.sampled_from(clippings)),
            sample_weights=draw_value(st.sampled_from(SAMPLE_WEIGHTS)),
            n_gradients=n_gradients,
            micro_batch=micro_batch,
            # Up to _STEPS windows, the last of any length (a short last
            # micro-batch, a short last window).
            samples=replicas * draw_value(st.integers(
                large // replicas, _STEPS * large // replicas)),
            seed=draw_value(st.integers(0, 2**16)),
            replicas=replicas,
        )

    return draw()


def two_replicas():
    """The suite's distribution over two devices (one a process, see
    `backends.two_replicas_distribution`), or None where there is none."""
    from backends import two_replicas_distribution

    distribution = two_replicas_distribution()
    return None if isinstance(distribution, str) else distribution


def _model(use, model_class, **kwargs):
    keras.utils.set_random_seed(use.seed)
    layers = keras.layers
    task = ARCHITECTURES[use.architecture]
    if "embedding" in use.architecture:
        inputs = keras.Input((5,), dtype="int32")
        masked = use.architecture == "embedding_masked_gru"
        hidden = layers.Embedding(_VOCABULARY, 8, mask_zero=masked)(inputs)
        hidden = (layers.GRU(8)(hidden) if masked
                  else layers.GlobalAveragePooling1D()(hidden))
    elif use.architecture in ("conv1d", "gru"):
        inputs = keras.Input((5, _FEATURES))
        hidden = (layers.Conv1D(8, 3, activation="relu")(inputs)
                  if use.architecture == "conv1d" else
                  layers.GRU(8, return_sequences=True)(inputs))
        hidden = layers.GlobalAveragePooling1D()(hidden)
    else:
        inputs = keras.Input((_FEATURES,))
        regularizer = (keras.regularizers.L2(0.01)
                       if use.architecture == "kernel_regularized" else None)
        first = layers.Dense(16, activation="tanh",
                             kernel_regularizer=regularizer)
        hidden = first(inputs)
        if use.architecture == "two_dense_shared":
            shared = layers.Dense(16, activation="tanh")
            hidden = shared(shared(hidden))
        elif use.architecture == "frozen_dense":
            frozen = layers.Dense(16, activation="tanh")
            hidden = frozen(hidden)
            frozen.trainable = False
        elif use.architecture == "layer_normalization":
            hidden = layers.LayerNormalization()(hidden)
    outputs = layers.Dense(3 if task == "regression" else 4)(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def _per_sample_own(y_true, y_pred):
    ops = keras.ops if KERAS_MAJOR == 3 else keras.backend
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


def _scalar_mean_own(y_true, y_pred):
    ops = keras.ops if KERAS_MAJOR == 3 else keras.backend
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
    }[use.loss]()


def _optimizer(use):
    optimizers = keras.optimizers
    clipping = {"none": {}, "clipnorm": {"clipnorm": 0.1},
                "global_clipnorm": {"global_clipnorm": 0.1},
                "clipvalue": {"clipvalue": 0.05}}[use.clipping]
    make = {
        "sgd": lambda: optimizers.SGD(0.05, **clipping),
        "sgd_momentum": lambda: optimizers.SGD(0.05, momentum=0.9,
                                               **clipping),
        "adam": lambda: optimizers.Adam(0.01, **clipping),
        "adamw": lambda: optimizers.AdamW(0.01, weight_decay=0.01,
                                          **clipping),
        "rmsprop": lambda: optimizers.RMSprop(0.01, **clipping),
        "adagrad": lambda: optimizers.Adagrad(0.05, **clipping),
        "nadam": lambda: optimizers.Nadam(0.01, **clipping),
        "adamax": lambda: optimizers.Adamax(0.01, **clipping),
    }[use.optimizer]
    return make()


def _data(use):
    rng = np.random.default_rng(use.seed)
    samples = use.samples
    if "embedding" in use.architecture:
        x = rng.integers(1, _VOCABULARY, size=(samples, 5)).astype("int32")
        x[rng.random(samples) < 0.3, 3:] = 0  # padding
    elif use.architecture in ("conv1d", "gru"):
        x = rng.normal(size=(samples, 5, _FEATURES)).astype("float32")
    else:
        x = rng.normal(size=(samples, _FEATURES)).astype("float32")
    if ARCHITECTURES[use.architecture] == "regression":
        y = rng.normal(size=(samples, 3)).astype("float32")
    else:
        y = rng.integers(0, 4, size=(samples,)).astype("int32")
        if use.loss == "categorical_logits":
            y = np.eye(4, dtype="float32")[y]
    weights = {"none": None,
               "positive": rng.uniform(0.5, 2.0, samples),
               "with_zeros": rng.uniform(0.5, 2.0, samples)
               * (rng.random(samples) < 0.7)}[use.sample_weights]
    if weights is not None:
        weights = weights.astype("float32")
    return x, y, weights


def run(use):
    """Trains `use` three ways (see the module) and returns an `Outcome`."""
    x, y, sample_weight = _data(use)
    large_batch = use.n_gradients * use.micro_batch
    start = _model(use, keras.Model).get_weights()

    def fit(model, batch_size, order, data="arrays"):
        model.set_weights(start)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.compile(optimizer=_optimizer(use), loss=_loss(use))
            keras.utils.set_random_seed(use.seed)
            arrays = (x[order], y[order]) + (
                () if sample_weight is None else (sample_weight[order],))
            if data == "arrays":
                model.fit(*arrays[:2], batch_size=batch_size,
                          sample_weight=(arrays[2] if len(arrays) > 2
                                         else None),
                          epochs=1, shuffle=False, verbose=0)
            else:
                model.fit(_batches(arrays, batch_size, data), epochs=1,
                          shuffle=False, verbose=0)
        # The library's warnings point at the line that called it (here);
        # Keras's own about the data (a generator that ran out) point
        # into Keras.
        messages = [str(w.message) for w in caught
                    if issubclass(w.category, UserWarning)
                    and not _inside_a_library(w.filename)]
        return model.get_weights(), messages

    in_order = np.arange(use.samples)
    reference, plain_messages = fit(_model(use, keras.Model), large_batch,
                                    in_order)
    try:
        with (two_replicas().scope() if use.replicas == 2
              else contextlib.nullcontext()):
            accumulated, messages = fit(
                _model(use, AccumulatingModel, n_gradients=use.n_gradients),
                use.micro_batch, in_order, use.data)
    except ValueError as error:
        return Outcome(False, (), str(error), float("nan"), float("nan"))
    warned = tuple(dict.fromkeys(m for m in messages
                                 if m not in plain_messages))
    difference = _max_difference(accumulated, reference)
    largest = max(float(np.max(np.abs(w))) for w in reference if w.size)
    floor = float(np.finfo(np.float32).eps) * largest
    # The floor: how far the large batch moves with each batch's samples in
    # other orders (reversed, and two shuffles), trained only while the
    # difference is above the floor so far. One order is not enough where
    # Adam's normalization turns the rounding of a gradient that nearly
    # cancels into a step: 4.2e-7 reversed, up to 5.1e-6 shuffled (AdamW,
    # an Embedding, keras 3.15.1 on torch).
    rng = np.random.default_rng(use.seed)
    for reorder in (lambda batch: batch[::-1], rng.permutation,
                    rng.permutation):
        if difference <= FLOOR_FACTOR * floor:
            break
        reordered = fit(_model(use, keras.Model), large_batch,
                        np.concatenate([
                            reorder(in_order[begin:begin + large_batch])
                            for begin in range(0, use.samples, large_batch)
                        ]))[0]
        floor = max(floor, _max_difference(reordered, reference))
    return Outcome(difference <= FLOOR_FACTOR * floor, warned, "",
                   difference, floor)


def _inside_a_library(filename):
    return any(f"{os.sep}{name}{os.sep}" in filename
               for name in ("keras", "tf_keras", "tensorflow", "jax"))


def _batches(arrays, batch_size, data):
    """The micro-batches of `arrays` as `data` hands them to `fit()`: a
    Python generator (of unknown length), a `PyDataset` or a `tf.data`
    dataset."""
    starts = range(0, len(arrays[0]), batch_size)
    if data == "generator":
        return (tuple(a[i:i + batch_size] for a in arrays) for i in starts)
    if data == "tf_data":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return len(starts)

        def __getitem__(self, index):
            return tuple(a[starts[index]:starts[index] + batch_size]
                         for a in arrays)

    return Batches()


def _max_difference(weights_a, weights_b):
    return max((float(np.max(np.abs(a - b))) for a, b in
                zip(weights_a, weights_b) if a.size), default=0.0)


def reproduction(use, outcome):
    """A script that runs `use` again from the repository's root."""
    return (
        f"accumulation differed quietly: {outcome.difference:.3e} against "
        f"a floor of {outcome.floor:.3e} (allowed {FLOOR_FACTOR:g} times "
        "over), with no warning. To run it again, from the repository's "
        "root:\n\n"
        "import sys\n"
        "sys.path.insert(0, 'tests')\n"
        "import fuzz\n"
        f"print(fuzz.run(fuzz.{use!r}))\n")


def _long_run(count, first_seed=None):
    """Runs `count` uses (the same ones each time for a `first_seed`, or
    with none) and prints a line a use, the counts, the warnings given where
    the use was exact, and each quiet difference's reproduction."""
    from hypothesis import HealthCheck, given, seed, settings

    counts = {"uses": 0, "exact": 0, "warned": 0, "warned but exact": 0,
              "refused": 0, "quiet differences": 0}
    failures = []
    noise = {}

    @settings(max_examples=count, deadline=None, database=None,
              derandomize=first_seed is None,
              suppress_health_check=list(HealthCheck))
    @seed(first_seed or 0)
    @given(use=uses())
    def one(use):
        outcome = run(use)
        counts["uses"] += 1
        counts["exact"] += outcome.exact
        counts["warned"] += bool(outcome.warned)
        counts["warned but exact"] += outcome.warned_but_exact
        if outcome.warned_but_exact:
            for message in outcome.warned:
                noise[message[:120]] = noise.get(message[:120], 0) + 1
        counts["refused"] += bool(outcome.refused)
        if not outcome.passes:
            counts["quiet differences"] += 1
            failures.append(reproduction(use, outcome))
            print(failures[-1], flush=True)
        # One line a use, so that a run cut short still says what it did.
        print(counts["uses"], "quiet difference" if not outcome.passes
              else "refused" if outcome.refused else "warned but exact"
              if outcome.warned_but_exact else "warned" if outcome.warned
              else "exact", use, flush=True)

    one()
    for name, value in counts.items():
        print(f"{name}: {value}")
    for message, times in sorted(noise.items(), key=lambda item: -item[1]):
        print(f"warned where exact, {times} times: {message}")
    for failure in failures:
        print("\n" + failure)


if __name__ == "__main__":
    _long_run(int(sys.argv[1]) if len(sys.argv) > 1 else 100,
              int(sys.argv[2]) if len(sys.argv) > 2 else None)
