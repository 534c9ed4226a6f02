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
import inspect
import random
import threading
import warnings

import numpy as np

from accum_model._chooser import adapter
from accum_model._chooser import keras
from accum_model._existing_models import accumulating
from accum_model._existing_models import check_is_keras_model
from accum_model.accumulating_model import AccumulatingModel
from accum_model.core import class_tree
from accum_model.core.messages import counted
from accum_model.core.settings import Settings

# How far above the float32 rounding floor the accumulating copy may land
# and still count as the large batch: summation orders differ between the
# two.
FLOOR_FACTOR = 10.0
# The same above a 16-bit floor, which is a bound already: models the
# differential fuzzer found exact (within 4 times how far 16 bits move the
# large batch from its float32 training) landed up to 3.7 times their
# weight's floor (LayerNormalization under mixed_bfloat16 with SGD, keras
# 3.15.1 on TensorFlow: `python tests/fuzz.py --check 60 70000`). A
# difference within it cannot be told from 16-bit rounding; a gradient
# scaled twice or a skipped window lands orders further.
FLOOR_FACTOR_16 = 4.0
# How many times the distance between the large batch's 16-bit training and
# its float32 twin a 16-bit weight may land from the large batch (the
# differential fuzzer's measure of the same).
PRECISION_FACTOR = 4.0
# The relative spacing of 16-bit floats a layer may compute in: each
# micro-batch's gradient is rounded to it where the large batch rounds the
# whole batch's once.
_EPSILON_16 = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# How far (relative to the largest output) a training pass on a reordered
# batch may land from the reordered outputs of the batch: rounding of
# statistics over the batch, not a draw.
_ORDER_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
# Layers that draw random numbers in training whatever they hold.
_RANDOM_LAYER_CLASSES = ("Dropout", "SpatialDropout1D", "SpatialDropout2D",
                         "SpatialDropout3D", "AlphaDropout",
                         "GaussianDropout", "GaussianNoise")
# The attributes through which Keras's random layers and cells take their
# rates (Dropout's `rate`, an RNN cell's `dropout` and `recurrent_dropout`,
# MultiHeadAttention's `_dropout`, GaussianNoise's `stddev`): 0 draws
# nothing.
_RATE_ATTRIBUTES = ("rate", "dropout", "recurrent_dropout", "_dropout",
                    "stddev")
# Optimizers whose update is not linear in the gradient: given a sparse
# gradient with a repeated row, Keras's own apply each occurrence in turn.
_SPARSE_ROW_OPTIMIZERS = ("Adam", "AdamW", "Adamax", "Nadam", "RMSprop",
                          "Adagrad", "Adadelta", "Adafactor", "Ftrl", "Lion",
                          "Lamb")


@dataclasses.dataclass(frozen=True)
class LargeBatchComparison:
    """What `compare_with_large_batch` found.

    Attributes:
        max_weight_difference: Float. The largest absolute difference of a
            weight between the accumulating copy and the large batch's.
        rounding_floor: Float. How far the large batch lands from itself,
            at the weight that decides the verdict: run twice, and with
            each batch's samples in another order (at least float32's
            epsilon times the largest weight). Where that weight's gradient
            passes through a layer computing in float16 or bfloat16, at
            least that type's epsilon times the weight's largest change in
            the large batch's training.
        matches: Bool, or None. Whether every weight of the accumulating
            copy lands within its allowed difference of the large batch's
            (with their random layers switched off, where the model has
            any); None where randomness the check cannot switch off or
            seed makes any verdict chance (see `causes`).
        causes: Tuple of str. What in the model or its set-up makes the two
            differ, each naming what to change: random layers, narrow
            accumulators, and every warning the accumulating copy raised
            that the large batch's did not (BatchNormalization in training,
            a loss whose divisor cannot be read, ...).
        difference_without_random_layers: Float, or None. The same
            comparison with the copies' random layers switched off (their
            rates set to 0), where the model has any; the rounding floor
            is then measured with them off too.
        windows: Int. Optimizer updates each copy made.
        rounding_dtype: Str. The coarsest float type the model's layers
            compute in.
        allowed_difference: Float. How far the weight that decides the
            verdict may land from the large batch's: `FLOOR_FACTOR` times
            the float32 floor, or its 16-bit floor where that is larger.
        deciding_weight: Str. The weight whose difference is the largest
            share of its allowed difference.
    """

    max_weight_difference: float
    rounding_floor: float
    matches: object
    causes: tuple
    difference_without_random_layers: object
    windows: int
    rounding_dtype: str = "float32"
    allowed_difference: float = 0.0
    deciding_weight: str = ""

    def __str__(self):
        without_random = self.difference_without_random_layers
        switched = ("" if without_random is None
                    else " with the copies' random layers switched off")
        compared = (self.max_weight_difference if without_random is None
                    else without_random)
        if self.matches is None:
            lines = [
                "cannot tell whether accumulation matches the large batch "
                f"over {counted(self.windows, 'window')}{switched}: randomness "
                "no seed "
                "controls moves the large batch itself (max |weight "
                f"difference| {compared:.2e}, a chance one)"]
        else:
            verdict = "matches" if self.matches else "differs from"
            lines = [
                f"accumulation {verdict} the large batch over "
                f"{counted(self.windows, 'window')}{switched}: max |weight "
                "difference| "
                f"{compared:.2e}; at '{self.deciding_weight}', the closest "
                f"to its bound, {self.allowed_difference:.2e} allowed "
                f"({self.rounding_dtype} rounding floor "
                f"{self.rounding_floor:.2e})"]
        if without_random is not None:
            lines.append("with them on: max |weight difference| "
                         f"{self.max_weight_difference:.2e}")
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
    switchable, unswitchable = _random_layers(model)
    rounding_dtype = _coarsest_compute_dtype(model)
    start = model.get_weights()
    in_order = np.arange(samples)

    def train(copy_settings, window_batch, order, switch_off,
              in_float32=False):
        """The copy's weights after training, its warnings, and whether
        its loss scaling skipped a step."""
        copy = _compiled_copy(model, copy_settings, in_float32)
        if switch_off:
            _switch_off_random_layers(copy)
        x_, y_, w_ = (_take(part, order) for part in (x, y, sample_weight))
        keras.utils.set_random_seed(seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            copy.fit(x_, y_, sample_weight=w_, batch_size=window_batch,
                     epochs=1, shuffle=False, verbose=0)
        return copy.get_weights(), caught, _skipped_a_step(copy)

    def large(order, switch_off):
        return _on_one_device(model, functools.partial(
            train, None, large_batch, order, switch_off))

    difference = None
    if switchable:
        # As the model is, for the report: its random layers draw other
        # numbers for micro-batches than for large batches.
        difference = _max_difference(
            train(settings, batch_size, in_order, False)[0],
            large(in_order, False)[0])
    accumulated, caught_accumulating, _ = train(settings, batch_size,
                                                in_order, True)
    reference, caught_large, skipped = large(in_order, True)
    repeated = large(in_order, True)[0]
    reordered = large(_reversed_within(samples, large_batch), True)[0]
    order_dependence = _on_one_device(model, functools.partial(
        _order_dependence, model, _take(x, in_order[:large_batch]), seed))
    # How far 16 bits move the large batch itself from its float32
    # training: where an optimizer that normalizes its steps (Adam,
    # RMSprop) turns rounding into steps, far beyond each gradient's own
    # rounding. Not where the large batch skipped a step for overflow:
    # that is no rounding, and its float32 twin skips none.
    in_float32 = None
    if rounding_dtype in _EPSILON_16 and not skipped:
        with _float32_policy():
            try:
                in_float32 = _on_one_device(model, functools.partial(
                    train, None, large_batch, in_order, True, True))[0]
            except Exception:  # noqa: BLE001 - the floor stays its own
                in_float32 = None

    eps32 = float(np.finfo(np.float32).eps)
    largest = max((float(np.max(np.abs(w))) for w in reference if w.size),
                  default=0.0)
    repeat_gap = _max_difference(repeated, reference)
    # A reference that moves when run again the same way, or a training
    # pass whose outputs move with the order of the batch's samples, is
    # drawing numbers: its floor is chance, not rounding.
    uncontrolled = (
        repeat_gap > FLOOR_FACTOR * eps32 * max(largest, 1.0)
        or order_dependence > _ORDER_TOLERANCE[rounding_dtype])
    floors, allowed = _bounds(model, rounding_dtype, largest, reference,
                              repeated, reordered, start, in_float32)
    gaps = [_max_difference([a], [b])
            for a, b in zip(accumulated, reference)]
    shares = [gap / bound if bound else (np.inf if gap else 0.0)
              for gap, bound in zip(gaps, allowed)]
    deciding = int(np.argmax(shares)) if shares else 0
    checked = max(gaps, default=0.0)
    matches = None if uncontrolled else all(share <= 1.0 for share in shares)
    plain_messages = {str(w.message) for w in caught_large}
    # What the accumulating copy was told about the model (a library's
    # deprecation notice says nothing of it).
    new_warnings = list(dict.fromkeys(
        str(w.message) for w in caught_accumulating
        if issubclass(w.category, UserWarning)
        and str(w.message) not in plain_messages))
    causes = _causes(model, switchable, unswitchable, uncontrolled, matches,
                     settings)
    causes += [f"the accumulating copy warned: {message}"
               for message in new_warnings]
    names = _weight_names(model)
    return LargeBatchComparison(
        max_weight_difference=checked if difference is None else difference,
        rounding_floor=floors[deciding] if floors else 0.0,
        matches=matches, causes=tuple(causes),
        difference_without_random_layers=(None if difference is None
                                          else checked),
        windows=windows, rounding_dtype=rounding_dtype,
        allowed_difference=allowed[deciding] if allowed else 0.0,
        deciding_weight=names[deciding] if names else "")


def _bounds(model, rounding_dtype, largest, reference, repeated, reordered,
            start, in_float32=None):
    """Each weight's rounding floor and allowed difference.

    A weight whose gradient stays in float32 has the float32 floor: how far
    such weights of the large batch move when it is run again and with its
    samples reordered, at least float32's epsilon times the largest weight;
    allowed `FLOOR_FACTOR` times over. A weight whose gradient passes
    through a layer computing in 16 bits has its own floor: its own moves,
    at least its type's epsilon times its change in the large batch's
    training (each micro-batch's gradient is rounded to 16 bits where the
    large batch's is rounded once), allowed `FLOOR_FACTOR_16` times over;
    or, where that is further, `PRECISION_FACTOR` times how far it lands
    in the large batch's training from the same training in float32
    (`in_float32`, its weights; None where no float32 twin was made).
    """
    rounded = (_rounded_to_16_bits(model) if rounding_dtype in _EPSILON_16
               else [False] * len(reference))
    moves = [max(_max_difference([a], [b]), _max_difference([c], [b]))
             for a, b, c in zip(repeated, reference, reordered)]
    floor32 = max([float(np.finfo(np.float32).eps) * largest] + [
        move for move, in_16_bits in zip(moves, rounded) if not in_16_bits])
    floors, allowed = [], []
    twins = in_float32 if in_float32 is not None else [None] * len(start)
    for after, before, twin, move, in_16_bits in zip(reference, start, twins,
                                                     moves, rounded):
        if in_16_bits:
            floor = max(floor32, move, _EPSILON_16[rounding_dtype]
                        * _max_difference([after], [before]))
            precision = (0.0 if twin is None
                         else _max_difference([after], [twin]))
            floors.append(max(floor, precision))
            allowed.append(max(FLOOR_FACTOR * floor32,
                               FLOOR_FACTOR_16 * floor,
                               PRECISION_FACTOR * precision))
        else:
            floors.append(floor32)
            allowed.append(FLOOR_FACTOR * floor32)
    return floors, allowed


def _rounded_to_16_bits(model):
    """For each of `model`'s weights (in `get_weights()` order), whether
    its gradient may pass through a layer computing in float16 or bfloat16:
    that layer's own weights, and in a functional or sequential model those
    of the layers before it (every weight of a model of another kind)."""
    def computes_in_16_bits(layer):
        return any(str(inner.compute_dtype) in _EPSILON_16
                   for inner in class_tree.layers_of(layer))

    weights = model.weights
    ordered = isinstance(model, (adapter.Functional, keras.Sequential))
    if not ordered:
        return [computes_in_16_bits(model)] * len(weights)
    rounded = {}
    later = False
    for layer in reversed(model.layers):
        later = later or computes_in_16_bits(layer)
        for weight in layer.weights:
            rounded.setdefault(id(weight), later)
    return [rounded.get(id(weight), True) for weight in weights]


def _weight_names(model):
    return [getattr(weight, "path", None) or weight.name
            for weight in model.weights]


def _order_dependence(model, batch, seed):
    """How far a training pass of a copy of `model` (random layers
    switched off) over `batch` in reverse lands from the reversed outputs
    over `batch`, relative to the largest output: 0 for a pass that treats
    each sample alike, up to rounding where it takes statistics over the
    batch; far more where it draws numbers (a seed that repeats draws them
    by position)."""
    copy = _copy(model)
    _switch_off_random_layers(copy)
    reverse = np.arange(_num_samples(batch))[::-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keras.utils.set_random_seed(seed)
        forward = _as_arrays(copy(batch, training=True))
        keras.utils.set_random_seed(seed)
        backward = _as_arrays(copy(_take(batch, reverse), training=True))
    scale = max((float(np.max(np.abs(a))) for a in forward + backward
                 if a.size), default=0.0)
    gap = max((float(np.max(np.abs(a[reverse] - b)))
               for a, b in zip(forward, backward) if a.size), default=0.0)
    return gap / scale if scale else 0.0


def _as_arrays(outputs):
    """The float64 NumPy arrays of a model's outputs, flattened."""
    if outputs is None:
        return []
    if isinstance(outputs, dict):
        return [a for key in sorted(outputs) for a in _as_arrays(
            outputs[key])]
    if isinstance(outputs, (list, tuple)):
        return [a for part in outputs for a in _as_arrays(part)]
    ops = getattr(keras, "ops", None)
    array = (ops.convert_to_numpy(outputs) if ops is not None
             else outputs.numpy())
    return [np.asarray(array, dtype=np.float64)]


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


def _compiled_copy(model, settings, in_float32=False):
    """A copy of `model` with its weights, compiled as it is with a fresh
    copy of its optimizer; accumulating with `settings`, or plain Keras
    where `settings` is None. It is built under the strategy in force in
    this thread (the model's, or one device's in `_on_one_device`).
    `in_float32`: its float32 twin (see `_copy`), compiled without loss
    scaling, to be built and trained under the float32 global policy."""
    strategy = (getattr(model, "distribute_strategy", None)
                if settings is not None else None)
    with (strategy.scope() if strategy is not None
          else contextlib.nullcontext()):
        copy = _copy(model, in_float32)
        arguments = dict(adapter.compile_arguments(model))
        optimizer = model.optimizer
        if in_float32:
            optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        arguments.update(
            optimizer=type(optimizer).from_config(optimizer.get_config()),
            metrics=None, weighted_metrics=None)
        copy.compile(**arguments)
    if settings is not None:
        accumulating(copy, **settings.as_dict())
    elif isinstance(copy, AccumulatingModel):
        accumulating(copy, n_gradients=1)
    return copy


def _skipped_a_step(model):
    """Whether `model`'s loss scaling skipped a step for overflow since it
    was compiled: its dynamic scale below its initial one (a short check
    grows it in no step)."""
    scaling = adapter.LossScaling(model.optimizer)
    if not scaling.active:
        return False
    initial = float(scaling.loss_scale_optimizer.initial_scale)
    return float(np.array(scaling.current_scale())) < initial


# The dtype policies a float32 twin computes in float32 instead.
_NARROW_POLICIES = ("mixed_float16", "mixed_bfloat16", "float16", "bfloat16")


def _in_float32(config):
    """`config` (a model's, nested) with each "dtype" that names a 16-bit
    or mixed policy, as a name or a policy's config, made float32."""
    if isinstance(config, list):
        return [_in_float32(value) for value in config]
    if not isinstance(config, dict):
        return config
    changed = {}
    for key, value in config.items():
        if key == "dtype" and _names_narrow_policy(value):
            changed[key] = "float32"
        else:
            changed[key] = _in_float32(value)
    return changed


def _names_narrow_policy(value):
    if isinstance(value, dict):
        value = (value.get("config") or {}).get("name")
    return value in _NARROW_POLICIES


@contextlib.contextmanager
def _float32_policy():
    """Keras's global dtype policy float32 while the block runs."""
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(policy)


def _copy(model, in_float32=False):
    """A copy of `model` with its weights: `keras.models.clone_model`'s,
    else its class rebuilt from `get_config`, uncompiled. The model's own
    layer classes are in scope, registered or not, and Keras's safe mode is
    lifted: the model is the caller's own, in this process (a `Lambda`'s
    Python function, a `TorchModuleWrapper`'s module). `in_float32`: its
    float32 twin, rebuilt from its config with every 16-bit or mixed dtype
    policy in it made float32 (`_in_float32`)."""
    classes = {type(layer).__name__: type(layer)
               for layer in class_tree.layers_of(model)}
    errors = []
    if in_float32:
        ways = (lambda model: type(model).from_config(
            _in_float32(model.get_config())),)
    else:
        ways = (keras.models.clone_model,
                lambda model: type(model).from_config(model.get_config()))
    with adapter.saving.unsafe_deserialization(), \
            keras.utils.custom_object_scope(classes), \
            adapter.saving.compiled_state_hidden(model):
        for make in ways:
            try:
                copy = make(model)
                # A keras-hub task clones with its tied embedding twice.
                copy.set_weights(model.get_weights())
                return copy
            except Exception as raised:  # The next way, or the error below.
                errors.append(raised)
    raise ValueError(_cannot_copy(model, errors)) from errors[-1]


def _cannot_copy(model, errors):
    """Why `compare_with_large_batch` cannot copy `model`, and the fix."""
    model_class = type(model)
    received = "; ".join(f"{type(error).__name__}: {error}"
                         for error in errors)
    own = [name for name, parameter in inspect.signature(
        model_class.__init__).parameters.items()
        if name != "self" and parameter.kind not in (
            parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]
    if (own and class_tree.overriding_classes(model_class, "__init__")
            and not class_tree.overriding_classes(model_class,
                                                  "get_config")):
        returned = ", ".join(f'"{name}": ...' for name in own)
        return (
            "`compare_with_large_batch` copies the model from its config, "
            f"and `{model_class.__name__}.__init__` takes arguments "
            f"({', '.join(own)}) that `get_config` does not return: give "
            f"`{model_class.__name__}` a `get_config` returning "
            f"`{{**super().get_config(), {returned}}}`. Received: "
            f"{received}")
    return (
        "`compare_with_large_batch` copies the model with "
        "`keras.models.clone_model`, or with `get_config` and "
        f"`from_config`, and neither works for `{model_class.__name__}`. "
        "Give the model a `get_config` that its `from_config` rebuilds it "
        f"from. Received: {received}")


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
                for layer in class_tree.layers_of(model)}
    return next((dtype for dtype in ("bfloat16", "float16")
                 if dtype in computed), "float32")


def _random_layers(model):
    """The layers of `model` that draw random numbers in training: those
    with a rate above 0 (which the check can set to 0), and those holding a
    random generator with no rate to read (each may or may not draw)."""
    switchable, unswitchable = [], []
    for layer in class_tree.layers_of(model)[1:]:
        if not (_is_random_class(layer)
                or adapter.draws_random_numbers(layer)):
            continue
        rates = _rates(layer)
        if not rates:
            unswitchable.append(layer)
        elif any(value > 0 for value in rates.values()):
            switchable.append(layer)
    return switchable, unswitchable


def _is_random_class(layer):
    return any(cls.__name__ in _RANDOM_LAYER_CLASSES
               and class_tree.is_keras_class(cls)
               for cls in type(layer).__mro__)


def _rates(layer):
    """`layer`'s rate attributes and their values."""
    rates = {}
    for name in _RATE_ATTRIBUTES:
        value = getattr(layer, name, None)
        if isinstance(value, (int, float, np.floating)) and not isinstance(
                value, bool):
            rates[name] = float(value)
    return rates


def _switch_off_random_layers(model):
    for layer in _random_layers(model)[0]:
        for name, value in _rates(layer).items():
            if value > 0:
                try:
                    setattr(layer, name, 0.0)
                except AttributeError:
                    # A property read from an inner cell, which is switched
                    # off itself.
                    pass


def _causes(model, switchable, unswitchable, uncontrolled, matches,
            settings):
    causes = []
    if switchable:
        names = ", ".join(f"'{layer.name}'" for layer in switchable)
        causes.append(
            f"random layers ({names}) draw their numbers per micro-batch, "
            "not per large batch, so the weights differ by chance"
            + ("; with them switched off the copies match the large batch"
               if matches else ""))
    if uncontrolled and unswitchable:
        names = ", ".join(f"'{layer.name}'" for layer in unswitchable)
        causes.append(
            f"layers ({names}) draw random numbers and have no rate to "
            "switch off, so the large batch differs from itself and no "
            "verdict can be given: check a copy of the model without "
            "them to tell accumulation from chance")
    elif uncontrolled:
        causes.append(
            "the large batch differs from itself when run again or with its "
            "samples reordered: something in the model draws random numbers "
            "that no Keras seed generator holds, or holds a seed that repeats "
            "its draws by position (a `torch.nn.Dropout` in a "
            "`TorchModuleWrapper`, `keras.random` calls without a "
            "`SeedGenerator`, a fixed integer seed), so no verdict can be "
            "given: check a copy of the model without them, or draw through "
            "a `keras.random.SeedGenerator` with a Keras rate")
    if settings.accumulator_dtype in ("float16", "bfloat16"):
        causes.append(
            f"accumulator_dtype='{settings.accumulator_dtype}' sums "
            "gradients in fewer bits than float32: set "
            "accumulator_dtype='float32' for float32 rounding")
    stray = _sparse_row_stray(model)
    if stray and matches is False:
        causes.append(stray)
    return causes


def _sparse_row_stray(model):
    """Where plain Keras's large batch strays from the single-device
    reference the window keeps: an Embedding's sparse gradient given to an
    optimizer that applies a repeated row's occurrences one at a time, or
    clipped by values or norms taken over the occurrences."""
    strays = adapter.SPARSE_ROW_STRAYS
    embeddings = [layer.name for layer in class_tree.layers_of(model)[1:]
                  if type(layer).__name__ == "Embedding"
                  and layer.trainable]
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    name = type(optimizer).__name__
    strays_by_optimizer = ("optimizer" in strays
                           and name in _SPARSE_ROW_OPTIMIZERS)
    clipping = [option for option in ("clipnorm", "global_clipnorm",
                                      "clipvalue")
                if "clipping" in strays
                and getattr(optimizer, option, None) is not None]
    if not embeddings or not (strays_by_optimizer or clipping):
        return ""
    what = " and ".join(
        ([f"its {name} applies"] if strays_by_optimizer else [])
        + ([f"its {', '.join(clipping)} clips"] if clipping else []))
    return (
        f"Embedding layers ({', '.join(embeddings)}) give TensorFlow's "
        f"sparse gradient rows, and plain Keras ({what}) a row that "
        "repeats within a batch one occurrence at a time, which strays from "
        "the large batch's gradient taken whole; the window takes it whole. "
        "The difference may be that stray: check with "
        "`keras.optimizers.SGD` and no clipping to see accumulation alone")
