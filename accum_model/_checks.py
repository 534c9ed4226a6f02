"""Checks of a model's set-up that raise, or warn, naming what to change.

Made at construction (keyword arguments), when training is set up
(`fit()`, `make_train_function`: optimizer, strategy, losses, layers,
overridden methods), and once when the training step is traced (the masked
activity penalty, which needs the prediction). The accumulating class in a
model's MRO is found by `class_tree.accumulating_base`.
"""

import math
import warnings

import numpy as np

from accum_model._chooser import adapter
from accum_model.core import class_tree
from accum_model.core import divisor
from accum_model.core import messages
from accum_model.core.messages import names_in_brief
from accum_model.core.messages import unexpected_keyword
from accum_model.core.settings import window_lengths
from accum_model.core.variables import flatten
from accum_model.core.variables import is_overwritten_with_gradient


def check_optimizer_does_not_accumulate(optimizer):
    """Refuses an optimizer that already accumulates gradients itself."""
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        steps = getattr(candidate, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "The optimizer passed to an AccumulatingModel must not "
                "accumulate gradients itself: the gradients would be "
                "accumulated twice. Set `n_gradients` on the model and leave "
                "the optimizer's `gradient_accumulation_steps` at None. "
                f"Received: gradient_accumulation_steps={steps!r} on "
                f"optimizer {candidate.__class__.__name__}"
            )


def check_loss_reductions(losses):
    """Refuses compiled losses whose reduction the window cannot reproduce.

    Args:
        losses: Flat list of what was passed to `compile(loss=...)`.
    """
    for loss in losses:
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction not in adapter.LOSS_REDUCTIONS:
            raise ValueError(
                "AccumulatingModel needs losses that Keras reduces to one "
                "number per batch (reduction in "
                f"{adapter.LOSS_REDUCTIONS}), so that a window can equal "
                "one large batch. Received: "
                f"reduction={reduction!r} on loss "
                f"{getattr(loss, 'name', loss)!r}"
            )


def check_keyword_arguments(model_class, kwargs, functional, own_arguments):
    """Refuses keyword arguments that nothing in the model would use.

    Keras's functional constructor ignores unknown keywords, so a misspelt
    `n_gradient=4` would silently train with `n_gradients=1`. Checked only
    where Keras's own constructor comes next after AccumulatingModel in the
    class's MRO: another model class there takes keywords of its own.

    Args:
        model_class: The class being constructed.
        kwargs: Keywords AccumulatingModel passes on to the next class.
        functional: Bool. Whether the call builds a functional model.
        own_arguments: AccumulatingModel's own keyword names.
    """
    if not class_tree.next_init_is_keras_model(
        model_class, class_tree.accumulating_base(model_class)
    ):
        return
    allowed = adapter.loop.model_keyword_arguments(functional)
    unknown = [name for name in kwargs if name not in allowed]
    if not unknown:
        return
    name = unknown[0]
    raise TypeError(unexpected_keyword(
        model_class.__name__, name, kwargs[name],
        set(own_arguments) | allowed))


def check_float8_on_one_replica(model):
    """Refuses float8 training (`overwrite_with_gradient`) across replicas.

    Those variables take the window's largest value; across replicas that
    would take a reduction by maximum that the window does not make.
    """
    replicas = adapter.replicas_in_sync(model)
    overwritten = [
        v.path if hasattr(v, "path") else v.name
        for v in model.trainable_variables
        if is_overwritten_with_gradient(v)
    ]
    if replicas > 1 and overwritten:
        raise ValueError(
            "AccumulatingModel trains float8 models (variables with "
            "`overwrite_with_gradient`, from `model.quantize('float8')`) on "
            "one replica only. Received: "
            f"{replicas} replicas and variables {overwritten[:3]}"
        )


def check_micro_batches_split_evenly(fit_arguments):
    """Refuses array data whose micro-batches the devices cannot share
    equally (JAX's `keras.distribution` cuts each batch into equal parts;
    plain Keras fails on such a batch too, but only when it comes).

    Args:
        fit_arguments: `fit()`'s arguments by name.
    """
    ways = adapter.batch_split_ways()
    samples = samples_in(fit_arguments.get("x"))
    if ways == 1 or samples is None:
        return
    validation_split = fit_arguments.get("validation_split") or 0.0
    if validation_split:
        samples = int(math.floor(samples * (1.0 - validation_split)))
    batch_size = fit_arguments.get("batch_size") or 32
    last = samples % batch_size
    uneven = [size for size in (batch_size, last) if size % ways]
    if not uneven:
        return
    if batch_size % ways:
        problem = f"batch_size={batch_size} is not a multiple of {ways}"
    else:
        problem = (f"{samples} training samples in micro-batches of "
                   f"{batch_size} leave a last micro-batch of {last}")
    raise ValueError(
        f"The distribution splits each micro-batch equally across its {ways} "
        f"devices, and {problem}. Pass a `batch_size` that is a multiple of "
        f"{ways}, and a number of training samples whose remainder after "
        f"dividing by `batch_size` is a multiple of {ways} too (or drop the "
        f"last samples). Received: batch_size={batch_size}, "
        f"samples={samples}")


def samples_in(x):
    """The number of samples in array data, or None for other data."""
    values = flatten(x)
    shape = getattr(values[0], "shape", None) if values else None
    if not shape or shape[0] is None:
        return None
    return int(shape[0])


def check_steps_per_execution(model):
    """Refuses executions of several steps where Keras can cut one short."""
    steps = adapter.loop.steps_per_execution(model)
    if steps > 1 and not adapter.executions_stop_cleanly_at_end_of_data():
        raise ValueError(
            f"{adapter.STEPS_PER_EXECUTION_FIX}. Received: "
            f"steps_per_execution={steps}"
        )


def check_no_foreign_layers(model):
    """Refuses layers of another Keras inside the model.

    Keras 3 does not track the weights of Keras 2 (`tf_keras`) layers, nor
    Keras 2 those of Keras 3 layers, so they would train nothing. Found as
    attributes of any layer, also inside lists, tuples and dicts, and (on
    Keras 2) applied in a functional graph, where only their variables
    remain.
    """
    # Each foreign layer once, by its shortest path (Keras 2 also lists
    # tracked attributes in containers of its own).
    shortest = {}
    for layer in class_tree.layers_of(model):
        for path, item in _attribute_values(layer):
            if adapter.is_foreign_layer(item):
                known = shortest.get(id(item), (None, path))[1]
                shortest[id(item)] = (item, min(known, path, key=len))
    foreign = sorted(
        f"{path} ({type(item).__module__}.{type(item).__name__})"
        for item, path in shortest.values()
    ) + [
        f"a layer applied in the functional graph (its variables reach "
        f"{name!r})"
        for name in adapter.foreign_variables_in_graph(model)
    ]
    if foreign:
        raise ValueError(
            "The model holds layers of another Keras, whose weights the "
            "model's Keras does not see and would never train: "
            + ", ".join(foreign)
            + ". Build the model from the layers of one Keras: `keras` "
            "(Keras 3) throughout, or `tf_keras` throughout with "
            "TF_USE_LEGACY_KERAS=1."
        )


def _attribute_values(layer, depth=3):
    """(path, value) for a layer's attributes and what containers hold."""
    found = []

    def walk(path, value, depth):
        found.append((path, value))
        if depth == 0 or isinstance(value, (str, bytes)):
            return
        if isinstance(value, dict):
            items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            return
        for item_path, item in items:
            walk(item_path, item, depth - 1)

    for name, value in vars(layer).items():
        walk(f"{layer.name}.{name}" if layer.name else name, value, depth)
    return found


def check_micro_batch_size_reaches_the_step(model):
    """Refuses `micro_batch_size` where a `train_step` of the user's own
    hands gradients to the window: that step receives whole batches, which
    only AccumulatingModel's own step splits."""
    micro_batch_size = model._accumulation.settings.micro_batch_size
    if (micro_batch_size is None
            or not model._accumulation.own_step_feeds_window):
        return
    raise ValueError(
        f"{type(model).__name__}.train_step hands its gradients to the "
        "window itself, and receives whole batches: `micro_batch_size` "
        "splits batches only in AccumulatingModel's own `train_step`. Split "
        "the batch in your step and call `accumulate_gradients` once per "
        "micro-batch, or set micro_batch_size=None and pass batches of the "
        "micro-batch's size with `n_gradients`. Received: "
        f"micro_batch_size={micro_batch_size}")


def warn_if_train_step_bypasses_window(model_class):
    """Warns when an overridden `train_step` never reaches the window.

    Such a step usually applies the optimizer itself on every micro-batch,
    which is no accumulation at all. A step that calls
    `accumulate_gradients` or `super().train_step` is fine.
    """
    base = class_tree.accumulating_base(model_class)
    shadowed = class_tree.overriding_classes(
        model_class, "train_step", start_after=base
    )
    if shadowed:
        warnings.warn(
            f"{shadowed[0].__qualname__}.train_step is not used: "
            "AccumulatingModel's own `train_step` comes first in the MRO of "
            f"{model_class.__name__}. To keep a custom step, override "
            "`train_step` in a subclass of AccumulatingModel and hand each "
            "micro-batch's gradients to `self.accumulate_gradients`.",
            stacklevel=3,
        )
    names = class_tree.names_used_by_overrides(
        model_class, "train_step", stop_at=base
    )
    if names is None or (class_tree.WINDOW_HOOKS | {"train_step"}) & names:
        return
    warnings.warn(
        f"{model_class.__name__}.train_step is overridden and calls neither "
        "`self.accumulate_gradients(gradients, weight)` nor "
        "`super().train_step(data)`, so it does not accumulate: the "
        "optimizer would be applied on every micro-batch and `n_gradients` "
        "would be ignored. Hand each micro-batch's gradients to "
        "`accumulate_gradients` instead of `optimizer.apply_gradients`.",
        stacklevel=3,
    )


def warn_if_loss_divisor_is_unknown(model_class, warn):
    """Returns whether micro-batches must be weighted by their sample count.

    True, with a one-time warning, when `compute_loss` is overridden and
    `micro_batch_weight` is not: what that loss divides by is unknown.
    """
    overrides_loss = bool(
        class_tree.overriding_classes(model_class, "compute_loss")
    )
    base = class_tree.accumulating_base(model_class)
    overrides_weight = model_class.micro_batch_weight is not (
        base.micro_batch_weight
    )
    if not overrides_loss or overrides_weight:
        return False
    warn(
        f"{model_class.__name__} overrides `compute_loss`, so accum_model "
        "cannot tell what it divides a micro-batch's loss by, and weights "
        "each micro-batch by its number of samples. That is exact for a "
        "loss that is a mean over samples; for any other (e.g. a mean "
        "over tokens or valid time steps) override "
        "`micro_batch_weight(x, y, y_pred, sample_weight)` to return what "
        "the loss divides by.",
    )
    return True


def _tried_on_parts(function, batch, samples_axis=0):
    """`function`'s values (floats) on the first 3 samples of the generated
    `batch` (8 samples on `samples_axis`, `_generated_batch`), on the other
    5 and on all 8; None where it fails on any (what it does with a batch
    cannot be told)."""
    first, rest = np.split(batch, [3], axis=samples_axis)
    parts = (first, rest, batch)
    try:
        return [adapter.value_of_call(function, part) for part in parts]
    except Exception:  # noqa: BLE001 - any failure: it cannot be told
        return None


def _is_mean_of_parts(values, tolerance=1e-4):
    """Whether `_tried_on_parts`'s values make the whole batch's the mean
    of the parts', weighted by their samples (3 and 5)."""
    first, second, both = values
    return math.isclose(both, (3.0 * first + 5.0 * second) / 8.0,
                        rel_tol=tolerance, abs_tol=1e-12)


def _is_sum_of_parts(values, tolerance=1e-4):
    """Whether `_tried_on_parts`'s values make the whole batch's the sum of
    the parts'."""
    first, second, both = values
    return math.isclose(both, first + second, rel_tol=tolerance,
                        abs_tol=1e-12)


def note_losses_that_are_means(model):
    """Finds the compiled loss functions of the user's that return their
    batch's mean over the samples as one number, which the window weighs
    exactly (`divisor.micro_batch_weight`'s `mean_losses`): each is tried on
    generated targets and predictions of every output's shape, of 3 and 5
    samples and the 8 together. One that returns a value per sample, fails,
    or is not such a mean for some output is left out (and warned about
    where it returns one number).
    """
    shapes = []
    for output in getattr(model, "outputs", None) or ():
        shape = tuple(output.shape[1:])
        if all(d is not None for d in shape):
            shapes.append(shape)
    found = []
    for loss in flatten(model.loss):
        function = divisor.loss_function(loss)
        if (not callable(function) or not shapes
                or divisor.is_keras_own(function)
                or divisor.is_keras_own(type(function))):
            continue
        if all(_is_a_mean_over_samples(function, shape)
               for shape in shapes):
            found.append(function)
    model._accumulation.mean_loss_functions = found


def _generated_batch(shape, dtype, seed=0, padded=True):
    """8 samples of `shape` to try a function of a batch on: values in
    (0.05, 0.95), or ones for integers (indices valid in any vocabulary).
    `padded`: sample 0 is zeros, and samples 4 and 5 are -1 and -100 (for
    integers 0), so that a mean over the values a mask keeps (padding
    left out) is not a mean over the samples of the batch's parts (3 and
    5 samples).
    """
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.floating):
        batch = np.random.default_rng(seed).uniform(0.05, 0.95,
                                                    (8,) + shape)
    else:
        batch = np.ones((8,) + shape)
    if padded:
        batch[0] = 0
        batch[4] = -1 if np.issubdtype(dtype, np.floating) else 0
        batch[5] = -100 if np.issubdtype(dtype, np.floating) else 1
    return batch.astype(dtype)


def _is_a_mean_over_samples(function, shape):
    """Whether loss `function`, on generated targets and predictions of
    `shape` per sample, gives one number that is the mean of its values
    on the batch's parts, weighted by their samples."""
    pairs = np.stack([_generated_batch(shape, "float32"),
                      _generated_batch(shape, "float32", seed=1,
                                       padded=False)])
    values = _tried_on_parts(lambda pair: function(pair[0], pair[1]), pairs,
                             samples_axis=1)
    return values is not None and _is_mean_of_parts(values)


def warn_if_batch_statistics_differ(model, warn):
    """Warns when a BatchNormalization layer trains on micro-batches.

    In training it normalises each micro-batch with that micro-batch's own
    mean and variance, so the gradients are not the large batch's. Where
    the window takes over its moving statistics (Keras 3's layer, in the
    built-in training step) those are the large batch's; elsewhere they move
    once per micro-batch, and the warning says so. A frozen layer
    (`trainable=False`) runs in inference mode and stays exact.

    Args:
        model: The model about to train.
        warn: Callable taking a message, warning once per model.
    """
    warn_if_wrapped_modules_keep_batch_statistics(model, warn)
    training = [
        layer for layer in class_tree.layers_of(model)
        if layer is not model and layer.trainable and any(
            cls.__name__.startswith("BatchNormalization")
            or cls.__name__ == "SyncBatchNormalization"
            for cls in type(layer).__mro__ if class_tree.is_keras_class(cls)
        )
    ]
    if not training:
        return
    own_step = _has_own_step(model)
    pooled, unpooled = [], []
    for layer in training:
        pools = not own_step and adapter.pools_moving_statistics(layer)
        (pooled if pools else unpooled).append(layer.name)
    listing = ("`[l.name for l in model._flatten_layers() if isinstance(l, "
               "keras.layers.BatchNormalization)]`")
    choices = (
        "Freeze them (`layer.trainable = False`, as fine-tuning does), use "
        "GroupNormalization or LayerNormalization, or accept the difference."
    )
    if pooled:
        warn(
            f"BatchNormalization layers "
            f"{names_in_brief(sorted(pooled), listing)} train on "
            "micro-batches: the window moves their moving mean and variance "
            "once, from the micro-batches' pooled moments, which are the "
            "large batch's for a layer with no training BatchNormalization "
            "upstream (for the layers after one, they are the moments of "
            "inputs normalised per micro-batch); and each micro-batch is "
            "normalised with its own statistics in the forward pass, so the "
            "gradients are not the large batch's. " + choices
        )
    if unpooled:
        where = (
            "a training step of the model's own (`accumulate_gradients`)"
            if own_step else "this Keras or this layer configuration"
        )
        warn(
            f"BatchNormalization layers "
            f"{names_in_brief(sorted(unpooled), listing)} train on "
            "micro-batches: each normalises with its micro-batch's own "
            "statistics and, in "
            f"{where}, moves its moving mean and variance once per "
            "micro-batch, so they are not the large batch's and the window "
            "is not exact. " + choices
        )


def _has_own_step(model):
    """Whether the model's class has a training step of the user's own
    that does not go through the built-in one: its forward pass runs where
    the window cannot see it."""
    step_names = class_tree.names_used_by_overrides(
        type(model), "train_step",
        stop_at=class_tree.accumulating_base(type(model)),
    )
    return step_names is not None and "train_step" not in step_names


def warn_if_wrapped_modules_keep_batch_statistics(model, warn):
    """Warns when a layer wraps a module of another framework that keeps
    running batch statistics (`torch.nn.BatchNorm1d` in a
    `keras.layers.TorchModuleWrapper`, say).

    Such a module normalises each micro-batch with its own statistics and
    moves its running mean and variance on every micro-batch, out of the
    window's reach. Found by what the module holds (`named_modules()`, and
    a submodule's `running_mean` with `track_running_stats`), without
    importing its framework.

    Args:
        model: The model about to train.
        warn: Callable taking a message, warning once per model.
    """
    found = []
    for layer in class_tree.layers_of(model):
        module = getattr(layer, "module", None)
        named_modules = getattr(module, "named_modules", None)
        if layer is model or not callable(named_modules):
            continue
        found += [
            f"{layer.name}.{name}" if name else layer.name
            for name, submodule in named_modules()
            if getattr(submodule, "track_running_stats", False)
            and getattr(submodule, "running_mean", None) is not None]
    if found:
        warn(
            f"Wrapped modules {sorted(found)} keep running batch statistics "
            "(such as torch.nn.BatchNorm1d): they normalise each "
            "micro-batch with its own statistics and move their running "
            "mean and variance on every micro-batch, which the window "
            "cannot pool, so neither is the large batch's. Use "
            "keras.layers.BatchNormalization (whose moving statistics the "
            "window moves once per window), GroupNorm or LayerNorm, or "
            "accept the difference."
        )


def warn_if_layers_add_losses(model, warn):
    """Warns when layers add losses of their own (`add_loss` in `call`, or
    in a method of the user's own that `call` reaches) that a window cannot
    weigh as the large batch does.

    Keras adds such a term as the layer computes it, and a window weighs it
    like a mean over its micro-batch, as Keras's regularizers are: exact
    for a mean of per-sample values (or a constant), which is not warned
    about. Each layer is tried on two batches of generated inputs of 3 and
    5 samples and on both together (`_added_loss_growth`): a term summed
    over the batch would train 1/n_gradients as strong as in the large
    batch; one of the batch's statistics cannot be weighed at all. A layer
    that cannot be tried (its input shape unknown, several inputs, random
    numbers drawn in `call`) is warned about as either. Under losses
    reduced with "sum", the loss's own warning speaks of added terms
    (`divisor.micro_batch_weight`).

    Args:
        model: The model about to train.
        warn: Callable taking a message, warning once per model.
    """
    adding = [layer for layer in class_tree.layers_of(model)
              if "add_loss" in _names_reached_from_call(type(layer))]
    model._accumulation.layers_adding_means = []
    losses = flatten(model.loss)
    if not adding or (losses and all(
            getattr(loss, "reduction", None) == "sum" for loss in losses)):
        return
    growth = {layer.name: _added_loss_growth(layer) for layer in adding}
    # A mean is exact where micro-batches are weighted by their samples;
    # the traced step tells where they are not
    # (`divisor.warn_if_activity_penalty_is_misweighted`).
    model._accumulation.layers_adding_means = sorted(
        name for name, grows in growth.items() if grows == "mean")
    summed = sorted(name for name, grows in growth.items() if grows == "sum")
    other = sorted(name for name, grows in growth.items() if grows is None)
    if summed:
        warn(
            f"Layers {summed} add losses with `add_loss` that are sums over "
            "the batch (on two batches of generated inputs together, the "
            "term was the sum of its values on each). A window weighs each "
            "added term like a mean over its micro-batch, as Keras's "
            "regularizers are, so such a term counts 1/n_gradients as much "
            "as in the large batch: divide such a term by the batch size "
            "(a mean of per-sample values is exact)."
        )
    if other:
        warn(
            f"Layers {other} add losses with `add_loss` that are neither a "
            "mean nor a sum of per-sample values over the batch (on two "
            "batches of generated inputs together), or could not be tried "
            "so (an input shape not known, several inputs, or random "
            "numbers drawn in `call`). A window weighs each added term "
            "like a mean over its micro-batch, as Keras's regularizers "
            "are: exact for a term that is a mean of per-sample values "
            "over the batch (or a constant); a term summed over the batch "
            "would count 1/n_gradients as much as in the large batch "
            "(divide such a term by the batch size). A term computed from "
            "the batch's statistics (a product of batch means, as a "
            "mixture of experts' load-balancing loss) is taken of each "
            "micro-batch's, and no weighting of the micro-batches gives "
            "the large batch's: accept the difference, or compute it from "
            "per-sample values."
        )


def _added_loss_growth(layer):
    """How the losses `layer` adds in a training call grow with its batch:
    "mean", "sum", or None where they are neither or cannot be tried.

    Tried on generated inputs of the layer's input shape, 3 and 5 samples
    and the 8 together; the layer's variables are put back as they were
    (a layer that draws random numbers is not tried: its generator would
    move).
    """
    layers = list(layer._flatten_layers())
    if any(adapter.draws_random_numbers(sublayer)
           or "random" in _names_reached_from_call(type(sublayer))
           for sublayer in layers):
        return None
    try:
        shape = tuple(layer.input.shape[1:])
        dtype = np.dtype(getattr(layer.input.dtype, "name",
                                 layer.input.dtype))
    except (AttributeError, ValueError, RuntimeError, TypeError):
        return None
    if not shape or any(d is None for d in shape):
        return None
    inputs = _generated_batch(shape, dtype)
    variables = list(layer.variables)
    saved = [np.array(variable) for variable in variables]

    def added_losses(batch):
        layer(batch, training=True)
        return sum(layer.losses)

    try:
        values = _tried_on_parts(added_losses, inputs)
    finally:
        for variable, value in zip(variables, saved):
            if not np.array_equal(np.array(variable), value):
                variable.assign(value)
    if values is None:
        return None
    # A layer computing in 16 bits rounds each value to about 1e-3 (float16)
    # or 1e-2 (bfloat16); a mean over padding left out is off by a tenth.
    tolerance = (3e-2 if str(getattr(layer, "compute_dtype", "float32"))
                 in ("float16", "bfloat16") else 1e-4)
    if _is_mean_of_parts(values, tolerance):
        return "mean"
    if _is_sum_of_parts(values, tolerance):
        return "sum"
    return None


def warn_if_activity_penalties_are_not_means(model, warn):
    """Warns when a layer's activity penalty, as Keras adds it to the loss,
    is not a mean over the samples of its batch.

    A window averages its micro-batches' losses weighted by their samples,
    which reproduces the large batch's penalty only where the penalty is
    such a mean. keras 3.14 and newer, and Keras 2, divide every activity
    penalty by the batch size, which makes a sum of per-sample penalties
    (Keras's own `L1`, `L2`) a mean; keras 3.6-3.13 add the penalty as it
    is, so a sum over the batch (`L1`, `L2`) weighs about n_gradients
    times too little in a window. A penalty on the batch's statistics (a
    sparsity penalty on the mean activation) is exact on neither. Tried on
    two batches of activations of the layer's output shape (or of 4 values
    where that is not known), of 3 and 5 samples, and on both together.

    Args:
        model: The model about to train.
        warn: Callable taking a message, warning once per model.
    """
    losses = flatten(model.loss)
    if losses and all(getattr(loss, "reduction", None) == "sum"
                      for loss in losses):
        # A window of losses reduced with "sum" adds its micro-batches'
        # penalties up; the loss's own warning speaks of other losses then
        # (`divisor.micro_batch_weight`).
        return
    divided = adapter.losses.activity_penalty_is_a_mean()
    not_means = []
    for layer in class_tree.layers_of(model):
        regularizer = getattr(layer, "activity_regularizer", None)
        if regularizer is None or (divided and class_tree.is_keras_class(
                type(regularizer))):
            continue
        values = _tried_on_parts(regularizer, _generated_batch(
            _sample_shape(layer), "float32", padded=False))
        # Divided by the batch size, a sum becomes a mean.
        adds_up = _is_sum_of_parts if divided else _is_mean_of_parts
        if values is None or not adds_up(values):
            not_means.append(layer.name)
    if not not_means:
        return
    if divided:
        warn(
            f"Layers {not_means} have an activity regularizer that is not a "
            "sum over the samples of its batch (on two batches of "
            "activations together it did not give the sum of its values on "
            "each, or could not be tried). Keras "
            "divides every activity penalty by the batch size: a sum of "
            "per-sample penalties (as keras.regularizers.L2) becomes a mean, "
            "exact under accumulation, but a mean, or a penalty on the "
            "batch's statistics (a sparsity penalty on the mean "
            "activation), is taken of each micro-batch and weighs "
            "n_gradients times as much: no weighting of the micro-batches "
            "gives the large batch's. Return the sum of per-sample "
            "penalties, or accept the difference."
        )
        return
    warn(
        f"Layers {not_means} have an activity regularizer whose penalty is "
        "not a mean over the samples of its batch (on two batches of "
        "activations together it did not give the mean of its values on "
        "each, weighted by their samples, or could not be tried). keras "
        f"{adapter.keras.__version__} adds an activity penalty to the loss "
        "as it is, without dividing it by the batch size: the sum over the "
        "batch that keras.regularizers.L1 and L2 give is taken of each "
        "micro-batch and weighs about n_gradients times too little in the "
        "window, and no weighting of the micro-batches gives the large "
        "batch's. keras 3.14 and newer divide the penalty by the batch "
        "size, which makes L1 and L2 exact: pip install 'keras>=3.14'. Or "
        "return the mean of per-sample penalties (e.g. ops.mean of them), "
        "exact on every Keras, or accept the difference."
    )


def warn_if_backups_fall_inside_windows(model, callbacks, warn):
    """Warns when a `BackupAndRestore` with an integer `save_freq` can back
    up inside a window.

    Keras restores such a backup by replaying its epoch from the first
    batch, on top of the weights and the window saved: the micro-batches
    before the backup are fed a second time into a window that already
    holds those of the open window. A backup at a window boundary holds no
    open window and replays as plain Keras's large batch does.

    Args:
        model: The model about to train.
        callbacks: `fit()`'s callbacks (a list or a `CallbackList`), or
            None.
        warn: Callable taking a message, warning once per model.
    """
    callbacks = getattr(callbacks, "callbacks", callbacks) or []
    settings = model._accumulation.settings
    lengths = window_lengths(settings.n_gradients)
    for callback in callbacks:
        save_freq = getattr(callback, "save_freq", None)
        if (isinstance(callback, adapter.keras.callbacks.BackupAndRestore)
                and isinstance(save_freq, int)
                and not isinstance(save_freq, bool)
                and any(save_freq % length for length in lengths)):
            warn(
                f"BackupAndRestore(save_freq={save_freq}) backs up inside "
                f"windows of n_gradients={settings.n_gradients!r} "
                "micro-batches. Keras restores such a backup by replaying "
                "its epoch from the first batch on top of the saved window, "
                "which then holds micro-batches twice: the resumed run "
                "leaves the large batch's. Give `save_freq` a multiple of "
                "every window's length, or 'epoch'."
            )


def _sample_shape(layer):
    """The shape of one sample of `layer`'s output, or (4,) where it is not
    known (a layer not built functionally, or called more than once)."""
    try:
        shape = tuple(layer.output.shape[1:])
    except (AttributeError, ValueError, RuntimeError):
        return (4,)
    if any(d is None for d in shape):
        return (4,)
    return shape


# What a layer's `call` names where it writes a variable of its own.
_VARIABLE_WRITES = ("assign", "assign_add", "assign_sub")


def warn_if_layers_write_variables(model, warn):
    """Warns when layers write variables in `call`: layers of the user's
    own (a running mean kept by hand, say), and Keras's own whose writes
    the window does not take over here
    (`adapter.writes_variables_per_micro_batch`).

    Such a write sees each micro-batch as its batch: it happens once per
    micro-batch, from that micro-batch, where the large batch makes it once,
    from the whole batch; the window cannot know a user's rule
    (BatchNormalization's it does know, see
    `warn_if_batch_statistics_differ`).

    Args:
        model: The model about to train.
        warn: Callable taking a message, warning once per model.
    """
    own_step = _has_own_step(model)
    writing = sorted(
        layer.name for layer in class_tree.layers_of(model)
        if set(_VARIABLE_WRITES) & _names_reached_from_call(type(layer))
        or adapter.writes_variables_per_micro_batch(layer, own_step)
    )
    if writing:
        warn(
            f"Layers {writing} write variables in `call` (such as "
            "`assign`, or SpectralNormalization's renormalized kernel). "
            "Where they do so in training, "
            "each write happens once per micro-batch, from that "
            "micro-batch, where the large batch makes it once, from the "
            "whole batch: what they hold is not the large batch's, nor is "
            "anything computed from it. Make such a write in inference "
            "only, or accept the difference."
        )


def _names_reached_from_call(layer_class):
    """The names a user's override of `call` uses, and those of the user's
    methods it reaches through them (`self._update()`, say)."""
    names = set()
    pending = ["call"]
    while pending:
        method = pending.pop()
        names.add(method)
        used = class_tree.names_used_by_overrides(layer_class, method,
                                                  stop_at=None) or set()
        pending += [name for name in used - names
                    if callable(getattr(layer_class, name, None))]
        names |= used
    return names


def warn_if_layers_carry_state(model, warn):
    """Warns about stateful recurrent layers (`stateful=True`): each
    micro-batch starts from the state the one before it left, where each
    sample of a large batch starts from the same sample's of the large
    batch before.

    Args:
        model: The model about to train.
        warn: Callable taking a message, warning once per model.
    """
    stateful = sorted(
        layer.name for layer in class_tree.layers_of(model)
        if getattr(layer, "stateful", False) is True
        and not isinstance(layer, adapter.keras.Model))
    if stateful:
        warn(
            f"Layers {stateful} are stateful (`stateful=True`): each "
            "micro-batch starts from the state the micro-batch before it "
            "left, whose samples are others, where each sample of the large "
            "batch continues the same sample of the large batch before. "
            "Set stateful=False, or accept the difference."
        )


def warn_if_float16_weights_have_several_uses(model, warn):
    """Warns, under float16 loss scaling, about layers whose weights a step
    uses more than once: shared layers (called more than once) and
    recurrent layers (a weight a time step).

    The window decides whether the large batch's float16 gradient of a
    weight overflows from the weight's summed gradient; the large batch
    overflows in the float16 part of each use, before the uses are added
    in float32. The two agree for a weight used once.

    Args:
        model: The model about to train.
        warn: Callable taking a message, warning once per model.
    """
    if not adapter.LossScaling(model.optimizer).active:
        return
    reused = sorted(
        layer.name for layer in class_tree.layers_of(model)
        if layer is not model and layer.trainable
        and layer.trainable_weights
        and getattr(layer, "compute_dtype", None) == "float16"
        and (isinstance(layer, adapter.keras.layers.RNN)
             or len(getattr(layer, "_inbound_nodes", ())) > 1))
    if reused:
        warn(messages.float16_check_of_reused_weights(reused))


def warn_if_accumulators_round_float64_weights(model, warn):
    """Warns when float64 weights have their gradients summed in a
    narrower `accumulator_dtype`: the window then equals the large batch
    to that dtype's precision, not float64's.

    Args:
        model: The model about to train.
        warn: Callable taking a message, warning once per model.
    """
    dtype = model._accumulation.settings.accumulator_dtype
    wide = sorted({layer.name for layer in class_tree.layers_of(model)
                   if layer is not model and layer.trainable
                   and (layer.trainable_weights or not layer.built)
                   and _dtype_name(getattr(layer, "dtype", None))
                   == "float64"})
    if dtype != "float64" and wide:
        warn(
            f"Layers {names_in_brief(wide, _FLOAT64_LISTING)} keep float64 "
            "weights, and the "
            f"window sums their gradients in {dtype}, so the update equals "
            f"the large batch's to {dtype}'s precision, not float64's. Set "
            "accumulator_dtype='float64' to sum them in float64. Received: "
            f"accumulator_dtype={dtype!r}"
        )


_FLOAT64_LISTING = ("`[l.name for l in model._flatten_layers() if l.dtype == "
                    "'float64']`")


def _dtype_name(dtype):
    return getattr(dtype, "name", dtype)


def check_ready_to_accumulate(model, requested_class):
    """Raises (or warns) before training if `model` cannot accumulate.

    Args:
        model: The model about to train.
        requested_class: The class the user asked for (see
            `_model_classes.requested_class`).

    Returns:
        Whether micro-batches are weighted by their number of samples
        (`compute_loss` overridden without `micro_batch_weight`).
    """
    check_optimizer_does_not_accumulate(model.optimizer)
    adapter.check_strategy(model)
    optimizer_stray = adapter.optimizer.check_optimizer(model.optimizer, model)
    check_loss_reductions(flatten(model.loss))
    check_no_foreign_layers(model)
    check_float8_on_one_replica(model)
    check_steps_per_execution(model)
    check_micro_batch_size_reaches_the_step(model)
    warn = model._accumulation.warn_once
    if optimizer_stray:
        warn(optimizer_stray)
    warn_if_batch_statistics_differ(model, warn)
    warn_if_layers_add_losses(model, warn)
    note_losses_that_are_means(model)
    warn_if_activity_penalties_are_not_means(model, warn)
    warn_if_layers_write_variables(model, warn)
    warn_if_layers_carry_state(model, warn)
    warn_if_float16_weights_have_several_uses(model, warn)
    warn_if_accumulators_round_float64_weights(model, warn)
    warn_if_train_step_bypasses_window(type(model))
    return warn_if_loss_divisor_is_unknown(requested_class, warn)

