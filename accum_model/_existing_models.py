"""`accumulating(model)`: gradient accumulation for a model that exists."""

from accum_model._adapter import keras

from accum_model import _checks
from accum_model import _model_classes
from accum_model._window_policy import WindowPolicy
from accum_model.accumulating_model import AccumulatingModel


def accumulating(model, n_gradients, flush_each_epoch=True,
                 accumulator_dtype="float32"):
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

    Args:
        model: A `keras.Model`.
        n_gradients: Int >= 1, micro-batches per optimizer update, or a
            schedule `{epoch: n}`. See `AccumulatingModel`.
        flush_each_epoch: Bool. See `AccumulatingModel`.
        accumulator_dtype: See `AccumulatingModel`.

    Returns:
        `model`, now an instance of `AccumulatingModel` as well.

    Raises:
        ValueError: `model` already accumulates with other settings, or has
            a window open.
    """
    policy = WindowPolicy(n_gradients, accumulator_dtype)
    n_gradients = policy.n_gradients
    flush_each_epoch = _checks.check_flush_each_epoch(flush_each_epoch)
    if not isinstance(model, keras.Model):
        raise ValueError(
            "`accumulating` takes a model of the Keras behind `tf.keras` in "
            f"this process, a `{keras.__name__}.Model` (for a tf_keras "
            "model, set TF_USE_LEGACY_KERAS=1 before TensorFlow is "
            "imported). Received: model of type "
            f"{type(model).__module__}.{type(model).__name__}"
        )
    if isinstance(model, AccumulatingModel):
        same = (model.n_gradients == n_gradients
                and model.flush_each_epoch == flush_each_epoch
                and model.accumulator_dtype == policy.accumulator_dtype)
        if same:
            return model
        open_steps = model._open_micro_steps()
        if open_steps:
            raise ValueError(
                "The model already accumulates and has a window open "
                f"({open_steps} micro-batches not yet applied). Call "
                "`model.apply_open_window()` first. Received: "
                f"n_gradients={n_gradients!r}, "
                f"flush_each_epoch={flush_each_epoch!r}, "
                f"accumulator_dtype={accumulator_dtype!r}"
            )
        if model.accumulator_dtype != policy.accumulator_dtype:
            # The window is rebuilt in the new dtype by the next step.
            model._gradient_window = None
            model._window_end = None
        model._window_policy = policy
        model.n_gradients = n_gradients
        model.flush_each_epoch = flush_each_epoch
        return model
    model.__class__ = _model_classes.accumulating_class(type(model))
    AccumulatingModel._init_accumulation(model, policy, flush_each_epoch)
    # A compiled model has traced (or may trace) Keras's own step.
    model.train_function = None
    return model
