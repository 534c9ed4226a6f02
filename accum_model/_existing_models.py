"""`accumulating(model)`: gradient accumulation for a model that exists."""

import functools

from accum_model import _model_classes
from accum_model._chooser import adapter
from accum_model._chooser import keras
from accum_model.accumulating_model import AccumulatingModel
from accum_model.core.messages import unexpected_keyword
from accum_model.core.settings import Settings

# One accumulating class per model class, made on first use.
_accumulating_classes = {}


def check_is_keras_model(model, taker):
    """Refuses anything but a model of the Keras that trains, naming the
    function `taker` that was given it."""
    if isinstance(model, keras.Model):
        return
    received = f"{type(model).__module__}.{type(model).__name__}"
    if isinstance(model, keras.layers.Layer):
        raise ValueError(
            f"`{taker}` takes a model, and was given a layer: wrap it in "
            f"one first, e.g. `{keras.__name__}.Sequential([layer])` or a "
            f"functional `{keras.__name__}.Model(inputs, layer(inputs))`. "
            f"Received: model of type {received}"
        )
    other_keras = type(model).__module__.split(".")[0] in ("keras",
                                                            "tf_keras")
    hint = (" (for a tf_keras model, set TF_USE_LEGACY_KERAS=1 before "
            "TensorFlow is imported; for a Keras 3 model, leave it unset)"
            if other_keras else "")
    raise ValueError(
        f"`{taker}` takes a `{keras.__name__}.Model`, the Keras behind "
        f"`tf.keras` in this process{hint}. Received: model of type "
        f"{received}"
    )


def accumulating(model, n_gradients=None, flush_each_epoch=True,
                 accumulator_dtype="float32", measure_noise_scale=False,
                 micro_batch_size=None, memory_limit=None, **unknown):
    """Makes an existing Keras model accumulate gradients.

    The model itself is changed and returned: its class becomes a subclass
    of both its own class and `AccumulatingModel`, so it keeps its layers,
    weights, compilation, `compute_loss`, preprocessor and methods, and
    `fit()` applies one update per `n_gradients` micro-batches. Use it for a
    model from `keras.models.load_model`, a keras-hub `from_preset`, a
    `keras.applications` constructor or a class you cannot change.

    A functional model (`keras.Model(inputs, outputs)`) is saved as an
    `AccumulatingModel` and loads as one, settings included. A model of any
    other class saves as that class; call `accumulating` again after loading.

    Called on a model that already accumulates, it gives the model these
    settings, as setting `model.n_gradients` and the others does: at a
    window boundary only.

    Args:
        model: A `keras.Model`.
        n_gradients: Int >= 1, micro-batches per optimizer update, or a
            schedule `{epoch: n}`. See `AccumulatingModel`.
        flush_each_epoch: Bool. See `AccumulatingModel`.
        accumulator_dtype: See `AccumulatingModel`.
        measure_noise_scale: Bool. See `AccumulatingModel`.
        micro_batch_size: None, an int >= 1 or "auto". See
            `AccumulatingModel`. Given alone, `n_gradients` is 1: one
            update per batch of `fit()`, split into micro-batches.
        memory_limit: None, or an int. See `AccumulatingModel`.

    Returns:
        `model`, now an instance of `AccumulatingModel` as well.

    Raises:
        ValueError: A setting is out of range, or `model` has a window open
            (`model.apply_open_window()` first) and the settings differ.
    """
    if n_gradients is None and micro_batch_size is not None:
        n_gradients = 1
    if unknown or n_gradients is None:
        _refuse_arguments(unknown)
    settings = Settings(n_gradients, flush_each_epoch, accumulator_dtype,
                        measure_noise_scale, micro_batch_size, memory_limit)
    check_is_keras_model(model, "accumulating")
    if not isinstance(model, AccumulatingModel):
        model.__class__ = accumulating_class(type(model))
    model._accumulate_with(settings)
    return model


def _refuse_arguments(unknown):
    """Names the keyword `accumulating` does not take (with the closest one
    it does), or the missing `n_gradients`."""
    taken = tuple(Settings.DEFAULTS)
    if not unknown:
        raise TypeError("accumulating() needs `n_gradients`, the "
                        "micro-batches per update: an int >= 1 or a "
                        "schedule {epoch: n}; or `micro_batch_size`, the "
                        "samples of the micro-batches each batch is split "
                        "into")
    name = next(iter(unknown))
    raise TypeError(unexpected_keyword("accumulating", name, unknown[name],
                                       taken, listed=True))


def accumulating_class(cls):
    """A subclass of `AccumulatingModel` and `cls`, for an existing model.

    Functional models serialize as `AccumulatingModel`, which Keras can
    rebuild from their config.
    """
    accumulating = _accumulating_classes.get(cls)
    if accumulating is None:
        # Not marked generated: it is the class the user's model now has.
        functional = cls is adapter.Functional
        accumulating = _model_classes.subclass_like(
            cls, (AccumulatingModel, cls), generated=False,
            serialized_as=AccumulatingModel if functional else cls,
            # Saved as `cls`, it loads as a model that does not accumulate.
            namespace={"_accum_model_loads_plain": not functional},
        )
        if cls is adapter.Functional:
            _model_classes.claim_functional_constructor(
                accumulating, AccumulatingModel
            )
        _accumulating_classes[cls] = accumulating
    return accumulating


def _clones_keep_accumulating(clone_sequential):
    """Wraps Keras's cloning of a `Sequential`, which makes every clone a
    plain `Sequential`: the clone of an accumulating one accumulates with
    the same settings, as clones of functional and subclassed models do."""

    @functools.wraps(clone_sequential)
    def clone_sequential_keeping_accumulation(model, *args, **kwargs):
        clone = clone_sequential(model, *args, **kwargs)
        if (isinstance(model, AccumulatingModel)
                and not isinstance(clone, AccumulatingModel)):
            accumulating(clone, **model._accumulation.settings.as_dict())
        return clone

    return clone_sequential_keeping_accumulation


adapter.saving.wrap_sequential_cloning(_clones_keep_accumulating)
