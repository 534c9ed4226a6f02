"""`compare_with_large_batch`: does accumulation train this model like the
large batch? A check users run on their own model and data.

Two copies of the model start from its weights with fresh copies of its
optimizer: one accumulates `n_gradients` micro-batches of `batch_size`, the
other is plain Keras on batches of `n_gradients * batch_size`, on the same
samples in the same order. A third, plain on the large batches with each
batch's samples reversed, is the same training in exact arithmetic: how far
it lands from the second is the float32 rounding floor. The model itself,
its optimizer and its state are left as they were.

The plain copies train on one device, the promise's reference: under a
`tf.distribute` strategy's replicas, plain Keras clips each replica's share
of the gradient, and before keras 3.8 it sums the replicas' mean losses.
"""

import contextlib
import dataclasses
import functools
import random
import threading
import warnings

import numpy as np

from accum_model._chooser import adapter
from accum_model._chooser import keras
from accum_model._existing_models import accumulating
from accum_model._existing_models import check_is_keras_model
from accum_model.accumulating_model import AccumulatingModel
from accum_model.core.settings import Settings

# How far above the rounding floor the accumulating copy may land and still
# count as the large batch: summation orders differ between the two.
FLOOR_FACTOR = 10.0
# The relative spacing of 16-bit floats a layer may compute in: each
# micro-batch's gradient is rounded to it where the large batch rounds the
# whole batch's once.
_EPSILON_16 = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# Layers that draw random numbers in training, and what switches each off.
_RANDOM_LAYER_SWITCHES = {"Dropout": "rate", "SpatialDropout1D": "rate",
                          "SpatialDropout2D": "rate",
                          "SpatialDropout3D": "rate", "AlphaDropout": "rate",
                          "GaussianDropout": "rate",
                          "GaussianNoise": "stddev"}


@dataclasses.dataclass(frozen=True)
class LargeBatchComparison:
    """What `compare_with_large_batch` found.

    Attributes:
        max_weight_difference: Float. The largest absolute difference of a
            weight between the accumulating copy and the large batch's.
        rounding_floor: Float. How far the large batch lands from itself
            with each batch's samples in another order (at least float32's
            epsilon times the largest weight; that alone where random layers
            could not be switched off). Where layers compute in float16 or
            bfloat16, at least that type's epsilon times the largest change
            of a weight in the large batch's training.
        matches: Bool. Whether the accumulating copy lands within
            `FLOOR_FACTOR` times `rounding_floor` of the large batch's
            (with their random layers switched off, where the model has
            any).
        causes: Tuple of str. What in the model or its set-up makes the two
            differ, each naming what to change: random layers, narrow
            accumulators, and every warning the accumulating copy raised
            that the large batch's did not (BatchNormalization in training,
            a loss whose divisor cannot be read, ...).
        difference_without_random_layers: Float, or None. The same
            comparison with the copies' random layers switched off (their
            rate or stddev set to 0), where the model has any; the rounding
            floor is then measured with them off too.
        windows: Int. Optimizer updates each copy made.
        rounding_dtype: Str. The coarsest float type the model's layers
            compute in, whose rounding the floor is.
    """

    max_weight_difference: float
    rounding_floor: float
    matches: bool
    causes: tuple
    difference_without_random_layers: object
    windows: int
    rounding_dtype: str = "float32"

    def __str__(self):
        verdict = "matches" if self.matches else "differs from"
        floor = (f"{self.rounding_dtype} rounding floor "
                 f"{self.rounding_floor:.2e}")
        without_random = self.difference_without_random_layers
        if without_random is None:
            lines = [
                f"accumulation {verdict} the large batch over "
                f"{self.windows} windows: max |weight difference| "
                f"{self.max_weight_difference:.2e}, {floor}"]
        else:
            lines = [
                f"accumulation {verdict} the large batch over "
                f"{self.windows} windows with the copies' random layers "
                f"switched off: max |weight difference| "
                f"{without_random:.2e}, {floor}",
                "with them on: max |weight difference| "
                f"{self.max_weight_difference:.2e}"]
        lines += [f"- {cause}" for cause in self.causes]
        return "\n".join(lines)


def compare_with_large_batch(model, x, y=None, *, batch_size, n_gradients,
                             steps=3, sample_weight=None, seed=0):
    """Trains copies of `model` with accumulation and with the large batch,
    and reports how far apart their weights land.

    Use it when accumulation seems to train differently from the large
    batch: it tells a real difference from float32 rounding and names what
    in the model explains it (Dropout and other random layers draw other
    numbers for micro-batches than for one large batch; BatchNormalization
    normalizes each micro-batch by its own statistics; a loss whose divisor
    accumulation cannot read, which it warns of; accumulators narrower than
    float32). `model` is not changed: the copies are made with
    `keras.models.clone_model` and compiled with fresh copies of its
    optimizer and its loss.

    Args:
        model: A compiled `keras.Model`, accumulating or not. Where it is an
            `AccumulatingModel`, its other settings (`accumulator_dtype`,
            ...) are the accumulating copy's.
        x: Input data: arrays, or a dict or list of arrays, as `fit()`
            takes them (not a dataset or generator).
        y: Target data, like `x`, or None.
        batch_size: Int >= 1. Samples per micro-batch.
        n_gradients: Int >= 1. Micro-batches per window.
        steps: Int >= 1. Windows to train: the first
            `steps * n_gradients * batch_size` samples (all of them where
            there are fewer; the last window may then be short).
        sample_weight: Optional sample weights, like `y`.
        seed: Int. Random seed set before each copy trains
            (`keras.utils.set_random_seed`). Python's and NumPy's global
            random state are put back as they were when the check returns;
            the backend's global seed stays set to `seed`.

    Returns:
        A `LargeBatchComparison`; `print()` it for a report.

    Raises:
        ValueError: `model` is not compiled, cannot be copied, or an
            argument is out of range.
    """
    _check_arguments(model, x, batch_size, steps, n_gradients)
    with _global_random_state_kept():
        return _compare(model, x, y, batch_size, n_gradients, steps,
                        sample_weight, seed)


@contextlib.contextmanager
def _global_random_state_kept():
    """Puts Python's and NumPy's global random state back as they were
    (`keras.utils.set_random_seed` seeds both)."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _compare(model, x, y, batch_size, n_gradients, steps, sample_weight,
             seed):
    """`compare_with_large_batch` once its arguments are checked."""
    settings = (model._accumulation.settings.as_dict()
                if isinstance(model, AccumulatingModel) else {})
    settings["n_gradients"] = n_gradients
    settings = Settings(**settings)
    samples = min(_num_samples(x), steps * n_gradients * batch_size)
    large_batch = n_gradients * batch_size
    windows = -(-samples // large_batch)
    random_layers = _random_layers(model)
    # Layers with no rate or stddev to set to 0 stay random in every run.
    still_random = [layer for layer in random_layers
                    if _random_switch(layer) is None]
    rounding_dtype = _coarsest_compute_dtype(model)
    # Where 16-bit rounding sets the floor, the weights' change sets its
    # scale; a float32 model needs no copy of its starting weights.
    start = (model.get_weights() if rounding_dtype in _EPSILON_16
             else None)

    def train(copy_settings, window_batch, order, switch_off_random_layers):
        """The copy's weights after training, and its warnings."""
        copy = _compiled_copy(model, copy_settings)
        if switch_off_random_layers:
            _switch_off_random_layers(copy)
        x_, y_, w_ = (_take(part, order) for part in (x, y, sample_weight))
        keras.utils.set_random_seed(seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            copy.fit(x_, y_, sample_weight=w_, batch_size=window_batch,
                     epochs=1, shuffle=False, verbose=0)
        return copy.get_weights(), caught

    def run(switch_off_random_layers, measure_floor):
        caught = {}
        trained = {}
        trained["accumulating"], caught["accumulating"] = train(
            settings, batch_size, np.arange(samples),
            switch_off_random_layers)
        runs = [("large", np.arange(samples))]
        if measure_floor:
            runs.append(("reordered",
                         _reversed_within(samples, large_batch)))
        for name, order in runs:
            trained[name], caught[name] = _on_one_device(
                model, functools.partial(train, None, large_batch, order,
                                         switch_off_random_layers))
        difference = _max_difference(trained["accumulating"],
                                     trained["large"])
        largest = max((float(np.max(np.abs(w))) for w in trained["large"]
                       if w.size), default=0.0)
        floor = float(np.finfo(np.float32).eps) * largest
        if rounding_dtype in _EPSILON_16:
            floor = max(floor, _EPSILON_16[rounding_dtype] * _max_difference(
                trained["large"], start))
        if measure_floor:
            floor = max(floor, _max_difference(trained["reordered"],
                                               trained["large"]))
        plain_messages = {str(w.message) for w in caught["large"]}
        # What the accumulating copy was told about the model (a
        # library's deprecation notice says nothing of it).
        new_warnings = list(dict.fromkeys(
            str(w.message) for w in caught["accumulating"]
            if issubclass(w.category, UserWarning)
            and str(w.message) not in plain_messages))
        return difference, floor, new_warnings

    # Reordered samples meet other random numbers: where the model has
    # random layers, the floor and the verdict come from the copies with
    # them off, and where some cannot be switched off, from float32's
    # epsilon alone.
    difference, floor, new_warnings = run(
        switch_off_random_layers=False, measure_floor=not random_layers)
    without_random = None
    if random_layers:
        without_random, floor, _ = run(switch_off_random_layers=True,
                                       measure_floor=not still_random)
    checked = difference if without_random is None else without_random
    matches = checked <= FLOOR_FACTOR * floor
    causes = _causes(random_layers, still_random, matches, settings)
    causes += [f"the accumulating copy warned: {message}"
               for message in new_warnings]
    return LargeBatchComparison(
        max_weight_difference=difference, rounding_floor=floor,
        matches=matches, causes=tuple(causes),
        difference_without_random_layers=without_random, windows=windows,
        rounding_dtype=rounding_dtype)


def _check_arguments(model, x, batch_size, steps, n_gradients):
    check_is_keras_model(model, "compare_with_large_batch")
    if getattr(model, "optimizer", None) is None or adapter.compile_arguments(
            model) is None:
        raise ValueError(
            "`compare_with_large_batch` copies the model's compiled loss "
            "and optimizer: call `model.compile(optimizer=..., loss=...)` "
            "first. Received: an uncompiled model")
    if not model.built:
        # Each copy would then create weights of its own at random.
        raise ValueError(
            "`compare_with_large_batch` starts every copy from the model's "
            "weights, and this model has none yet: build it first "
            "(`model.build(input_shape)`, call it on a batch, or begin it "
            "with `keras.Input`). Received: an unbuilt model")
    if isinstance(n_gradients, dict):
        raise ValueError(
            "`compare_with_large_batch` compares windows of one length: "
            "`n_gradients` must be an int >= 1 (to check a schedule, check "
            "each of its lengths). Received: "
            f"n_gradients={n_gradients!r}")
    for name, value in (("batch_size", batch_size), ("steps", steps),
                        ("n_gradients", n_gradients)):
        if isinstance(value, bool) or not isinstance(
                value, (int, np.integer)) or value < 1:
            raise ValueError(
                f"`{name}` must be an int >= 1. Received: {name}={value!r}")
    if _num_samples(x) == 0:
        raise ValueError(
            "`x` must hold arrays of samples (not a dataset or generator). "
            f"Received: x of type {type(x).__name__}")


def _on_one_device(model, work):
    """`work()`, run outside the strategy of a `model` on several replicas.

    A strategy's scope holds for the thread that entered it, so a thread of
    its own runs `work` on one device; it takes Keras's global dtype policy
    along (Keras 3 keeps it per thread).
    """
    if adapter.replicas_in_sync(model) == 1:
        return work()
    policy = keras.mixed_precision.global_policy()
    outcome = {}

    def run():
        keras.mixed_precision.set_global_policy(policy)
        try:
            outcome["value"] = work()
        except BaseException as error:  # Raised again in the caller.
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _compiled_copy(model, settings):
    """A copy of `model` with its weights, compiled as it is with a fresh
    copy of its optimizer; accumulating with `settings`, or plain Keras
    where `settings` is None. It is built under the strategy in force in
    this thread (the model's, or one device's in `_on_one_device`)."""
    strategy = (getattr(model, "distribute_strategy", None)
                if settings is not None else None)
    with (strategy.scope() if strategy is not None
          else contextlib.nullcontext()):
        copy = _copy(model)
        arguments = dict(adapter.compile_arguments(model))
        optimizer = model.optimizer
        arguments.update(
            optimizer=type(optimizer).from_config(optimizer.get_config()),
            metrics=None, weighted_metrics=None)
        copy.compile(**arguments)
    if settings is not None:
        accumulating(copy, **settings.as_dict())
    elif isinstance(copy, AccumulatingModel):
        accumulating(copy, n_gradients=1)
    return copy


def _copy(model):
    try:
        copy = keras.models.clone_model(model)
    except (ValueError, TypeError, NotImplementedError):
        try:
            copy = type(model).from_config(model.get_config())
        except Exception as error:
            raise ValueError(
                "`compare_with_large_batch` copies the model with "
                "`keras.models.clone_model`, or with `get_config` and "
                f"`from_config`, and neither works for `{type(model).__name__}`"
                f": {error}. Give the model a `get_config` that its "
                "`from_config` rebuilds it from.") from error
    copy.set_weights(model.get_weights())
    return copy


def _num_samples(data):
    if isinstance(data, dict):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        return min((_num_samples(part) for part in data), default=0)
    shape = getattr(data, "shape", None)
    return int(shape[0]) if shape else 0


def _take(data, index):
    """`data` (arrays, or dicts, lists and tuples of them) at `index`."""
    if data is None:
        return None
    if isinstance(data, dict):
        return {key: _take(value, index) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_take(part, index) for part in data)
    return np.asarray(data)[index]


def _reversed_within(samples, batch):
    """An order in which each batch holds its samples reversed."""
    return np.concatenate([np.arange(start, min(start + batch, samples))[::-1]
                           for start in range(0, samples, batch)])


def _max_difference(weights_a, weights_b):
    return max((float(np.max(np.abs(a - b))) for a, b in
                zip(weights_a, weights_b) if a.size), default=0.0)


def _coarsest_compute_dtype(model):
    """bfloat16 or float16 where a layer of `model` computes in it
    (bfloat16, the coarser, where both do), else float32."""
    computed = {str(layer.compute_dtype)
                for layer in adapter.layers_of(model)}
    return next((dtype for dtype in ("bfloat16", "float16")
                 if dtype in computed), "float32")


def _random_layers(model):
    """The model's layers that draw random numbers in training."""
    return [layer for layer in adapter.layers_of(model)[1:]
            if _random_switch(layer) is not None
            or adapter.draws_random_numbers(layer)]


def _random_switch(layer):
    """The attribute that switches `layer`'s randomness off, or None."""
    for cls in type(layer).__mro__:
        if cls.__name__ in _RANDOM_LAYER_SWITCHES and cls.__module__.split(
                ".")[0] in ("keras", "tf_keras"):
            return _RANDOM_LAYER_SWITCHES[cls.__name__]
    return None


def _switch_off_random_layers(model):
    for layer in _random_layers(model):
        switch = _random_switch(layer)
        if switch is not None:
            setattr(layer, switch, 0.0)


def _causes(random_layers, still_random, matches, settings):
    causes = []
    if random_layers:
        names = ", ".join(f"'{layer.name}'" for layer in random_layers)
        causes.append(
            f"random layers ({names}) draw their numbers per micro-batch, "
            "not per large batch, so the weights differ by chance"
            + ("; with them switched off the copies match the large batch"
               if matches and not still_random else ""))
    if still_random:
        names = ", ".join(f"'{layer.name}'" for layer in still_random)
        causes.append(
            f"random layers ({names}) have no rate or stddev to switch off: "
            "they stayed random, so the verdict compares against float32's "
            "epsilon, not a measured floor; check a copy of the model "
            "without them to tell accumulation from chance")
    if settings.accumulator_dtype in ("float16", "bfloat16"):
        causes.append(
            f"accumulator_dtype='{settings.accumulator_dtype}' sums "
            "gradients in fewer bits than float32: set "
            "accumulator_dtype='float32' for float32 rounding")
    return causes
