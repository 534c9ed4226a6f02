"""Argument validation, done before any training variable exists."""

import numbers

import tensorflow as tf


def check_n_gradients(n_gradients):
    """Returns `n_gradients` as an int, or raises a `ValueError`."""
    is_integer = isinstance(n_gradients, numbers.Integral) and not isinstance(
        n_gradients, bool
    )
    if not is_integer or n_gradients < 1:
        raise ValueError(
            "`n_gradients` must be an integer >= 1 (the number of "
            "micro-batches whose gradients make one update). "
            f"Received: n_gradients={n_gradients!r}"
        )
    return int(n_gradients)


def check_flush_each_epoch(flush_each_epoch):
    """Returns `flush_each_epoch`, or raises a `ValueError` if not a bool."""
    if not isinstance(flush_each_epoch, bool):
        raise ValueError(
            "`flush_each_epoch` must be True or False. "
            f"Received: flush_each_epoch={flush_each_epoch!r}"
        )
    return flush_each_epoch


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


MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def check_loss_reductions(losses):
    """Refuses compiled losses whose reduction the window cannot reproduce.

    Args:
        losses: Flat list of what was passed to `compile(loss=...)`.
    """
    for loss in losses:
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction not in MEAN_REDUCTIONS:
            raise ValueError(
                "AccumulatingModel supports losses that average over the "
                f"batch (reduction in {MEAN_REDUCTIONS}), so that a window "
                "can be weighted like one large batch. Received: "
                f"reduction={reduction!r} on loss "
                f"{getattr(loss, 'name', loss)!r}"
            )


def check_strategy(strategy):
    """Refuses distribution strategies whose variables live off-replica."""
    unsupported = (
        tf.distribute.experimental.ParameterServerStrategy,
        tf.distribute.experimental.CentralStorageStrategy,
    )
    if isinstance(strategy, unsupported):
        raise ValueError(
            "AccumulatingModel supports the default strategy, "
            "OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy "
            "and TPUStrategy, which keep a copy of every variable on each "
            "replica. Received: distribute_strategy="
            f"{strategy.__class__.__name__}"
        )
