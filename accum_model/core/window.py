"""The window as a value: its state and its transitions, written once.

A *window* is the `n_gradients` consecutive micro-batches whose gradients
make one optimizer update. Its state is a `WindowState`: the sum of each
micro-batch's gradient times its *weight* (what Keras divided its loss by,
see `divisor`), the sum of the weights, of the weighted losses and of the
samples, its counters, the gradient noise scale's sums and the pooled
moments of normalization layers. The promise lives here: dividing the
gradient sums by the total weight gives the gradient of the loss of the
concatenated micro-batches, the large batch's.

Every function is pure: it takes the state, what it needs of a micro-batch
and a `WindowConfig` settled when the window was built (or when its step
was traced), and returns new values; none reads anything else. Array
operations come through `ops`, the backend's `arithmetic.ArrayOps`
(`numpy_ops.NUMPY_OPS` in the core's own tests). Each backend is a store
that holds a state and runs these: JAX inside its jitted step, PyTorch
eagerly, TensorFlow on its per-replica variables.
"""

import typing

from accum_model.core import arithmetic


class WindowState(typing.NamedTuple):
    """The open window's values (a pytree of the backend's arrays)."""

    # One per trainable variable: the sum of gradient times weight, or, for
    # a variable Keras overwrites with its "gradient" (float8 statistics),
    # the largest value of the window's micro-batches.
    gradient_sums: list
    weight_sum: typing.Any
    loss_sum: typing.Any
    sample_sum: typing.Any
    micro_steps: typing.Any
    # Micro steps left before the epoch ends; negative when unknown.
    steps_left_in_epoch: typing.Any
    length: typing.Any
    next_length: typing.Any
    skipped_windows: typing.Any
    # The noise scale (zeros without `measure_noise_scale`): the window's
    # sum of v |g_v|^2, of v, its micro-batches with v > 0, and 0.0 while
    # its first micro-batches are missing from those sums (restored open);
    # then the epoch's summed estimates of tr(Sigma), |G|^2 and their count.
    noise_squared_norm_sum: typing.Any
    noise_weight_sum: typing.Any
    noise_micro_batches: typing.Any
    noise_measurable: typing.Any
    noise_trace_sum: typing.Any
    noise_signal_sum: typing.Any
    noise_estimates: typing.Any
    # Normalization layers' pooled moments: per pooled layer, [3, channels]
    # of element count, shifted sum and shifted sum of squares.
    statistics_sums: list
    # What the window end multiplies a window-scaled learning-rate schedule
    # by (1.0 without one).
    learning_rate_scale: typing.Any


class WindowConfig(typing.NamedTuple):
    """What a window's transitions need to know of its set-up.

    Args:
        overwrite: Tuple of bools, one per trainable variable: whether
            Keras overwrites it with its "gradient" (the window keeps the
            largest value instead of a sum).
        divide_by_weight: Bool. False when every loss term is a sum: the
            window is then the sum of its micro-batches, not their mean.
        measure_noise_scale: Bool. Whether the noise-scale sums move.
        has_gradient: Tuple of bools, one per variable: whether a
            micro-batch of the window gave it a gradient; None where every
            variable always has one (a traced step's never miss).
        float16: Tuple of bools, one per variable: whether the large
            batch's gradient of it is float16, whose scaled sum overflows
            where float16 does; empty where none is.
    """

    overwrite: tuple
    divide_by_weight: bool = True
    measure_noise_scale: bool = False
    has_gradient: typing.Optional[tuple] = None
    float16: tuple = ()


# The counters a new window starts from; the float ones are float32.
_FLOAT_ZEROS = ("weight_sum", "loss_sum", "sample_sum",
                "noise_squared_norm_sum", "noise_weight_sum",
                "noise_micro_batches")


def empty_state(shapes, accumulator_dtype, overwrite, length, ops,
                steps_left_in_epoch=-1, skipped_windows=0,
                statistics_sums=(), learning_rate_scale=1.0):
    """A window with nothing in it.

    Args:
        shapes: One shape per trainable variable.
        accumulator_dtype: Str. What gradients are summed in (float32 for a
            variable in `overwrite`).
        overwrite: Bools, one per variable (see `WindowConfig`).
        length: Int. Micro steps in the window.
        ops: The backend's `ArrayOps`.
        steps_left_in_epoch: Int. Negative when unknown.
        skipped_windows: Int. Windows skipped so far.
        statistics_sums: The pooled layers' empty sums.
        learning_rate_scale: Float.
    """

    def scalar(value, dtype="float32"):
        return ops.cast(value, dtype)

    return WindowState(
        gradient_sums=[
            ops.zeros(tuple(shape),
                      "float32" if kept else accumulator_dtype)
            for shape, kept in zip(shapes, overwrite)],
        **{name: scalar(0.0) for name in _FLOAT_ZEROS},
        micro_steps=scalar(0, "int32"),
        steps_left_in_epoch=scalar(steps_left_in_epoch, "int32"),
        length=scalar(length, "int32"),
        next_length=scalar(length, "int32"),
        skipped_windows=scalar(skipped_windows, "int32"),
        noise_measurable=scalar(1.0),
        noise_trace_sum=scalar(0.0), noise_signal_sum=scalar(0.0),
        noise_estimates=scalar(0.0),
        statistics_sums=list(statistics_sums),
        learning_rate_scale=scalar(learning_rate_scale),
    )


def micro_batch_added(config, state, gradients, weight, loss, samples, ops,
                      counts=True):
    """The window with one more micro-batch in it.

    Args:
        config: The `WindowConfig`.
        state: The `WindowState`.
        gradients: One gradient per variable (None or zeros where it had
            none), of the micro-batch's loss, a mean over `weight` elements.
        weight: Float32 scalar, what Keras divided the loss by.
        loss: Scalar, the micro-batch's loss; None where a step of the
            user's own reports no loss.
        samples: Float32 scalar, its samples.
        ops: The backend's `ArrayOps`.
        counts: Bool (or a bool scalar): whether the micro-batch counts as
            a micro step. An empty batch that a loop runs at the end of
            data on one replica while another has data does not.
    """
    return counters_added(config, state, gradients, weight, loss, samples,
                          ops, counts)._replace(
        gradient_sums=gradient_sums_added(config, state, gradients, weight,
                                          ops))


def gradient_sums_added(config, state, gradients, weight, ops):
    """The gradient sums with a micro-batch's gradients in. A window's
    first micro-batch writes over what its sums held (see `reset`)."""
    first = state.micro_steps == 0
    return [
        ops.where(first, ops.zeros_like(total), total) if gradient is None
        else largest(total, gradient, first, ops) if kept
        else ops.where(first, 0.0, total) + weighted(
            gradient, weight, ops.dtype_name(total), ops)
        for total, gradient, kept in zip(state.gradient_sums, gradients,
                                         config.overwrite)]


def counted_gradient_sums(state, ops):
    """The gradient sums as they count: zeros for a window with no micro
    step, whatever its store left in them (see `reset`)."""
    empty = state.micro_steps == 0
    return [ops.where(empty, ops.zeros_like(total), total)
            for total in state.gradient_sums]


def weighted(gradient, weight, dtype, ops):
    """What a micro-batch adds to a gradient sum of `dtype`: its gradient
    times its weight, multiplied in float32 (float64 for a float64 sum)."""
    wide = _wide(dtype)
    return ops.cast(ops.cast(gradient, wide) * ops.cast(weight, wide), dtype)


def _wide(dtype):
    """What a sum of `dtype` is computed in: float64 for float64, else
    float32."""
    return "float64" if dtype == "float64" else "float32"


def largest(total, gradient, first, ops):
    """A variable Keras overwrites with its "gradient" keeps the largest
    value of the window's micro-batches (as Keras's own accumulation)."""
    value = ops.cast(gradient, "float32")
    return ops.where(first, value, ops.maximum(total, value))


def counters_added(config, state, gradients, weight, loss, samples, ops,
                   counts=True):
    """Everything `added` moves but the gradient sums: weight, loss,
    samples, counters and noise sums."""
    step = (1 if counts is True else 0 if counts is False
            else ops.cast(counts, ops.dtype_name(state.micro_steps)))
    loss_sum = state.loss_sum
    if loss is not None:
        loss_sum = loss_sum + arithmetic.weighted_loss(
            ops.cast(loss, "float32"), weight, ops)
    return noise_added(config, state._replace(
        weight_sum=state.weight_sum + weight,
        loss_sum=loss_sum,
        sample_sum=state.sample_sum + samples,
        micro_steps=state.micro_steps + step,
        steps_left_in_epoch=state.steps_left_in_epoch - step,
    ), gradients, weight, samples, ops)


def noise_added(config, state, gradients, weight, samples, ops):
    """The window's noise sums with a micro-batch in; unchanged when the
    noise scale is not measured."""
    if not config.measure_noise_scale:
        return state
    squared_norm = squared_norm_of(
        [g for g, kept in zip(gradients, config.overwrite)
         if not kept and g is not None], ops)
    size = weight if config.divide_by_weight else samples
    return state._replace(
        noise_squared_norm_sum=state.noise_squared_norm_sum
        + arithmetic.noise_micro_batch_term(weight, squared_norm, size, ops),
        noise_weight_sum=state.noise_weight_sum + size,
        noise_micro_batches=state.noise_micro_batches
        + ops.where(size > 0, 1.0, 0.0))


def squared_norm_of(arrays, ops):
    """Float32: the sum of the squares of every element of `arrays` (a
    backend's own `squared_norm` where it has one: TensorFlow's sums a
    sparse gradient's repeated rows first)."""
    total = ops.cast(0.0, "float32")
    for array in arrays:
        total = total + (ops.squared_norm(array) if ops.squared_norm
                         else ops.sum(ops.square(ops.cast(array, "float32"))))
    return total


def ends(state):
    """Whether the window ends with the micro-batch just added: it is full,
    or its epoch has no micro step left."""
    return (state.micro_steps >= state.length) | (
        state.steps_left_in_epoch == 0)


def ends_with_next(state):
    """Whether the window ends with the next micro step that counts (as
    `ends` reads the state once that step is added), known before the
    step runs."""
    return ends(state._replace(
        micro_steps=state.micro_steps + 1,
        steps_left_in_epoch=state.steps_left_in_epoch - 1))


def total_weight(config, state, ops):
    """What the window's gradient sums are divided by: its weight, or 1
    for losses that are sums."""
    if config.divide_by_weight:
        return state.weight_sum
    return ops.ones_like(state.weight_sum)


def loss(config, state, ops):
    """The window's loss: the large batch's (a "sum" loss is the sum)."""
    return arithmetic.window_loss(state.loss_sum, state.weight_sum,
                                  config.divide_by_weight, ops)


def mean_gradients(config, state, dtypes, ops):
    """The window's gradient: the large batch's.

    One entry per variable, in the variable's dtype (`dtypes`): the gradient
    sum over the window's weight (a window of weight 0, every element
    masked, has a zero gradient, as Keras's `divide_no_nan` gives the large
    batch), the largest value for a variable Keras overwrites, and None for
    a variable no micro-batch of the window reached (as in the large
    batch).
    """
    weight = total_weight(config, state, ops)
    present = config.has_gradient or (True,) * len(state.gradient_sums)
    divided = [i for i, (total, kept, used) in enumerate(zip(
        state.gradient_sums, config.overwrite, present)) if used and not kept]
    means = {}
    if ops.divide_all_no_nan is not None:
        together = [i for i in divided
                    if ops.dtype_name(state.gradient_sums[i]) == "float32"]
        means = dict(zip(together, ops.divide_all_no_nan(
            [state.gradient_sums[i] for i in together],
            ops.cast(weight, "float32"))))
    for i in divided:
        if i not in means:
            wide = _wide(ops.dtype_name(state.gradient_sums[i]))
            means[i] = arithmetic.divide_no_nan(
                ops.cast(state.gradient_sums[i], wide),
                ops.cast(weight, wide), ops)
    return [
        None if not used
        else ops.cast(total, dtype) if kept
        else ops.cast(means[i], dtype)
        for i, (total, dtype, kept, used) in enumerate(zip(
            state.gradient_sums, dtypes, config.overwrite, present))]


def is_finite(state, ops):
    """Bool: whether every gradient sum is finite."""
    verdict = ops.cast(True, "bool")
    for total in state.gradient_sums:
        verdict = verdict & ops.all(ops.isfinite(total))
    return verdict


def fits_float16(config, state, loss_scale, ops):
    """Bool: whether the large batch's scaled float16 gradients stay in
    float16's range (see `arithmetic.fits_float16`); True where no
    variable's large-batch gradient is float16. A variable Keras overwrites
    holds no gradient sum and has no say."""
    flagged = [total for total, flag, kept in zip(
        state.gradient_sums, config.float16, config.overwrite)
        if flag and not kept]
    if not flagged:
        return ops.cast(True, "bool")
    largest = ops.cast(0.0, "float32")
    for total in flagged:
        largest = ops.maximum(largest,
                              ops.max(ops.abs(ops.cast(total, "float32"))))
    return arithmetic.fits_float16(largest, loss_scale,
                                   total_weight(config, state, ops))


def finite(config, state, loss_scale, ops):
    """Check: every gradient sum is finite (see `is_finite`)."""
    del config, loss_scale
    return is_finite(state, ops)


def in_float16_range(config, state, loss_scale, ops):
    """Check: the large batch's float16 gradients stay in float16's range
    at the `loss_scale` in force (see `fits_float16`)."""
    return fits_float16(config, state, loss_scale, ops)


def end_checks(loss_scaled, settings):
    """The checks a window's end makes before it applies the window: a
    tuple of functions `(config, state, loss_scale, ops) -> bool`, on the
    window summed over replicas; a window that fails one is skipped.

    Under loss scaling, as Keras's `LossScaleOptimizer` checks one large
    batch: the sums are finite, and the large batch's float16 gradients
    would have been. With narrow accumulators (`settings.may_overflow`,
    `settings` being the model's `Settings`), the sums are finite. Else
    none: every window applies.
    """
    if loss_scaled:
        return (finite, in_float16_range)
    if settings.may_overflow:
        return (finite,)
    return ()


def passes(checks, config, state, loss_scale, ops):
    """Bool scalar: whether the window passes every one of `checks`;
    Python's True for none, so that a store traces no condition.
    `loss_scale` is the scale in force, or None without one."""
    verdict = True
    for check in checks:
        verdict = _both(verdict, check(config, state, loss_scale, ops))
    return verdict


def window_estimates(config, state, ops):
    """The window's noise-scale estimates [tr(Sigma), |G|^2, 1.0], zeros
    where it cannot be measured: fewer than two micro-batches with data, or
    some of them missing from its sums (restored open)."""
    summed_norm = squared_norm_of(
        [s for s, kept in zip(state.gradient_sums, config.overwrite)
         if not kept], ops)
    trace, signal = arithmetic.noise_estimates(
        state.noise_squared_norm_sum, summed_norm, state.noise_weight_sum,
        state.noise_micro_batches, ops)
    measurable = (state.noise_micro_batches >= 2.0) & (
        state.noise_measurable > 0.0)
    return [ops.where(measurable, value, 0.0)
            for value in (trace, signal, ops.cast(1.0, "float32"))]


def with_estimates(state, estimates, ops, applied=True):
    """The state with `estimates` (`window_estimates`, or their sum over
    replicas) added to its epoch's where the window was `applied`."""
    trace, signal, count = (ops.where(applied, value, 0.0)
                            for value in estimates)
    return state._replace(
        noise_trace_sum=state.noise_trace_sum + trace,
        noise_signal_sum=state.noise_signal_sum + signal,
        noise_estimates=state.noise_estimates + count)


def reset(state, ops, zero_sums=None):
    """An empty window after `state`'s: it takes the next window's length,
    and keeps the epoch's counts and estimates. `zero_sums`, where given,
    are zero gradient sums the store has already.

    The sums of a window with no micro step are never read as they are
    (`gradient_sums_added`, `counted_gradient_sums`), so a store may keep
    the last window's sums instead of these zeros: a compiled step that
    empties them where the window might end holds every sum twice.
    """
    return state._replace(
        gradient_sums=(list(zero_sums) if zero_sums is not None
                       else [ops.zeros_like(s) for s in state.gradient_sums]),
        **{name: ops.zeros_like(getattr(state, name))
           for name in _FLOAT_ZEROS},
        micro_steps=ops.zeros_like(state.micro_steps),
        length=state.next_length,
        noise_measurable=ops.ones_like(state.noise_measurable),
        statistics_sums=[ops.zeros_like(s) for s in state.statistics_sums],
    )


class EndOfWindow(typing.NamedTuple):
    """What a store does as its window ends (see `ended`).

    Each bool is a Python bool where it is known when the step is traced
    (a store then traces no condition for it), else a bool scalar.
    """

    # Hand the optimizer the window's mean gradient (`mean_gradients`).
    applies: typing.Any
    # Tell the loss scale of an overflow, as after a large batch skipped.
    skips: typing.Any
    # Log the window's loss (`loss`) and move the pooled moving
    # statistics: applied or skipped, as the large batch's forward pass
    # does.
    reports: typing.Any
    # The empty window after this one.
    next_state: WindowState


def ended(config, state, ops, verdict=True, has_samples=True,
          estimates=None, zero_sums=None):
    """The end of the window `state`: what the store does, and the window
    after it.

    Args:
        config: The `WindowConfig`.
        state: The `WindowState` at its end, summed over replicas where
            there are several (the counters are each replica's own, equal
            on all of them).
        ops: The backend's `ArrayOps`.
        verdict: Bool (or bool scalar): whether the window passes its
            checks (`passes` with `end_checks`); one that fails is skipped
            and counted in `skipped_windows`.
        has_samples: Bool (or bool scalar): whether any micro-batch of the
            window had a sample. A window of empty steps alone (the end of
            data on some replicas) is emptied and nothing else.
        estimates: The window's noise-scale estimates where the store sums
            each replica's (`window_estimates`); None: `state`'s own.
        zero_sums: Zero gradient sums the store holds already (see
            `reset`), or None.
    """
    applies = _both(has_samples, verdict)
    skips = _both(has_samples, _negated(verdict))
    if config.measure_noise_scale:
        if estimates is None:
            estimates = window_estimates(config, state, ops)
        state = with_estimates(state, estimates, ops, applies)
    next_state = reset(state, ops, zero_sums)
    if skips is not False:
        next_state = next_state._replace(
            skipped_windows=next_state.skipped_windows + ops.cast(
                ops.where(skips, 1, 0),
                ops.dtype_name(state.skipped_windows)))
    return EndOfWindow(applies=applies, skips=skips, reports=has_samples,
                       next_state=next_state)


def _both(first, second):
    """`first and second` for Python bools or bool scalars, a Python bool
    where either is False or both are known."""
    if first is False or second is False:
        return False
    if first is True:
        return second
    if second is True:
        return first
    return first & second


def _negated(verdict):
    return (not verdict) if isinstance(verdict, bool) else ~verdict


def restored(state, counters, ops):
    """The state with a saved window's counters (a dict by field name) in.
    A window restored open is not measured: its micro-batches before the
    checkpoint are not in its noise sums."""
    return state._replace(
        **{name: ops.cast(value, ops.dtype_name(getattr(state, name)))
           for name, value in counters.items()},
        noise_squared_norm_sum=ops.zeros_like(state.noise_squared_norm_sum),
        noise_weight_sum=ops.zeros_like(state.noise_weight_sum),
        noise_micro_batches=ops.zeros_like(state.noise_micro_batches),
        noise_measurable=ops.cast(
            0.0 if counters["micro_steps"] else 1.0, "float32"))


def with_epoch(state, steps_left_in_epoch, ops, new_epoch=True):
    """The window as an epoch of `steps_left_in_epoch` micro steps (or -1,
    unknown) begins: a new epoch's noise scale is its own."""
    state = state._replace(steps_left_in_epoch=ops.cast(
        steps_left_in_epoch, ops.dtype_name(state.steps_left_in_epoch)))
    if not new_epoch:
        return state
    return state._replace(**{
        name: ops.zeros_like(getattr(state, name))
        for name in ("noise_trace_sum", "noise_signal_sum",
                     "noise_estimates")})


def with_length(state, length, ops):
    """The window with `length` from its next boundary on: an empty window
    takes it at once, an open one keeps its own."""
    length = ops.cast(length, ops.dtype_name(state.length))
    return state._replace(
        next_length=length,
        length=ops.where(state.micro_steps == 0, length, state.length))
