"""The window's numbers, written once for every backend.

Each function takes its arrays and `ops`, an `ArrayOps` of the running
backend (TensorFlow's window and JAX's each build one), and uses nothing
else: the weighting of micro-batches, the window's mean gradient and loss,
the loss-scale share of a micro-batch, the float16 overflow verdict and the
noise-scale estimates are the same arithmetic on every backend.

Vocabulary: a micro-batch's *weight* is what Keras divided its loss by
(`divisor`); the window holds the sum of each micro-batch's gradient times
its weight, so dividing by the window's total weight gives the large batch's
gradient.
"""

import collections

ArrayOps = collections.namedtuple("ArrayOps", [
    # NumPy's `where`, `minimum`, `maximum`, `zeros_like`, `ones_like`,
    # under the backend's own names.
    "where", "minimum", "maximum", "zeros_like", "ones_like",
    # `(x) -> x as float32`.
    "to_float32",
    # `divide_no_nan(numerator, denominator)` as one fused operation where
    # the backend has one (a traced TensorFlow window is smaller with it);
    # None to build it from `where`.
    "divide_no_nan",
    # What the window's transitions (`core.window`) use besides: NumPy's
    # `sum`, `square`, `abs`, `max` (of all elements), `all`, `isfinite`;
    # `cast(x, dtype_name)`, `zeros(shape, dtype_name)`, and
    # `dtype_name(x)`, its dtype as a string ("float32").
    "sum", "square", "abs", "max", "all", "isfinite", "cast", "zeros",
    "dtype_name",
    # `(x) -> float32 sum of x's squared elements`, where the backend's
    # arrays need more than `sum(square(x))` (TensorFlow's sparse
    # gradients); None otherwise.
    "squared_norm",
    # `(arrays, denominator) -> [divide_no_nan(a, denominator) for a in
    # arrays]` for float32 arrays, where the backend does it in fewer
    # operations than one per array (PyTorch's `torch._foreach_div_`); None
    # otherwise. It may divide `arrays` in place: the window end divides
    # its gradient sums last (`core.window.mean_gradients`).
    "divide_all_no_nan",
], defaults=(None,) * 12)

# The smallest magnitude float16 rounds to infinity (its largest finite
# value, 65504, plus half of its last step, 32).
FLOAT16_OVERFLOW = 65520.0


def divide_no_nan(numerator, denominator, ops):
    """`numerator / denominator`, and 0 where the denominator is 0, as
    Keras's losses divide (a window whose every element is masked has a
    zero gradient and a zero loss, as the large batch has)."""
    if ops.divide_no_nan is not None:
        return ops.divide_no_nan(numerator, denominator)
    is_zero = denominator == 0
    safe = ops.where(is_zero, ops.ones_like(denominator), denominator)
    return ops.where(is_zero, ops.zeros_like(numerator), numerator / safe)


def weighted_loss(loss, weight, ops):
    """A micro-batch's loss times its weight, for the window's loss sum: 0
    for a micro-batch of weight 0, also where its own mean is 0/0."""
    return ops.where(weight == 0, ops.zeros_like(weight), loss * weight)


def window_loss(loss_sum, total_weight, divide_by_weight, ops):
    """The window's loss: the large batch's (a "sum" loss is the sum)."""
    if not divide_by_weight:
        return loss_sum
    return divide_no_nan(loss_sum, total_weight, ops)


def micro_batch_share(length, micro_steps, steps_left_in_epoch, replicas,
                      ops, divide_by_weight=True, micro_batches=1):
    """Float32: the part of its window one replica's micro-batch is.

    1/(n * replicas * micro_batches), where n is the window's `length`, or
    the micro steps the epoch has left when those are fewer
    (`steps_left_in_epoch` counts this step; negative when unknown), and
    `micro_batches` what each step splits its batch into
    (`micro_batch_size`). A micro-batch's loss scaled by the
    loss scale times this share has the large batch's per-sample terms in
    its backward pass, so it overflows where the large batch would. A loss
    reduced with "sum" (`divide_by_weight` False) has them already: 1.
    """
    if not divide_by_weight:
        return ops.to_float32(1.0)
    expected = ops.where(
        steps_left_in_epoch >= 0,
        ops.minimum(length, micro_steps + steps_left_in_epoch), length,
    )
    return 1.0 / (ops.to_float32(ops.maximum(expected, 1) * replicas)
                  * ops.to_float32(micro_batches))


def fits_float16(largest_sum, loss_scale, total_weight):
    """Whether the large batch's scaled float16 gradient stays finite.

    For a weight used in float16, the large batch sums its samples'
    gradient terms in float16; its scaled gradient is the window's sum
    (`largest_sum`, the largest magnitude among those weights' sums) times
    the loss scale over the window's weight.
    """
    return largest_sum * loss_scale < FLOAT16_OVERFLOW * total_weight


def statistics_terms(count, mean, variance, shift, ops):
    """A micro-batch's share of a normalization layer's pooled moments.

    Per channel: its element count, the sum of its elements minus `shift`
    and the sum of their squares, from the batch's `mean` and (biased)
    `variance` over `count` elements. `shift` is the moving mean, constant
    through the window, so that the variance does not cancel
    catastrophically when the mean is large. A slice with no element adds
    nothing, also where its moments are 0/0.

    Returns:
        (count, shifted sum, shifted sum of squares), each [channels].
    """
    offset = mean - shift
    has_elements = count > 0
    zeros = ops.zeros_like(count)
    return (count,
            ops.where(has_elements, count * offset, zeros),
            ops.where(has_elements, count * (variance + offset * offset),
                      zeros))


def moments_of_parts(count, mean, variance, summed, ops):
    """The moments of a batch split into parts (one per device), from each
    part's own, in float32 (Chan et al.'s pairwise combination).

    Args:
        count, mean, variance: This part's element count and its biased
            moments, per channel.
        summed: `(x) -> x summed over the parts` (a collective), applied to
            tuples too.
        ops: The backend's `ArrayOps`.

    Returns:
        (count, mean, variance) of the whole batch, per channel; a channel
        with no element has mean and variance 0, as Keras's moments of
        nothing.
    """
    count = ops.to_float32(count)
    mean = ops.to_float32(mean)
    variance = ops.to_float32(variance)
    total, weighted = summed((count, count * mean))
    total_or_one = ops.where(total > 0, total, ops.ones_like(total))
    whole_mean = weighted / total_or_one
    whole_variance = summed(
        count * (variance + ops.square(mean - whole_mean))) / total_or_one
    return total, whole_mean, whole_variance


def pooled_moving_statistics(count, shifted_sum, shifted_square_sum, shift,
                             moving_mean, moving_variance, momentum, ops,
                             complement=None):
    """The moving mean and variance after one step by the large batch's
    moments, pooled from the window's `statistics_terms`.

    A channel no element reached has moments 0 and 0, as a layer's own
    masked moments give a batch with nothing unmasked.

    `momentum` is a float, or an array with one per channel (several
    layers moved at once); then `complement` holds, per channel, the
    float32 that the layer's own `1.0 - momentum` rounds to (computed in
    float32, it can differ in its last bit).
    """
    if complement is None:
        complement = 1.0 - momentum
    mean_offset = divide_no_nan(shifted_sum, count, ops)
    zeros = ops.zeros_like(count)
    variance = ops.maximum(
        divide_no_nan(shifted_square_sum, count, ops)
        - mean_offset * mean_offset, zeros)
    seen = count > 0
    mean = ops.where(seen, shift + mean_offset, zeros)
    variance = ops.where(seen, variance, zeros)
    return (moving_mean * momentum + mean * complement,
            moving_variance * momentum + variance * complement)


def noise_micro_batch_term(weight, squared_norm, size, ops):
    """One micro-batch's v |g_v|^2 for the noise scale.

    The window adds the micro-batch's gradient times `weight`, and
    `weight * g = v g_v` with v its `size` (what its loss was a mean over:
    `weight` itself for a mean, its samples for a "sum" loss), so
    v |g_v|^2 = weight^2 |g|^2 / v.
    """
    return divide_no_nan(weight * weight * squared_norm, size, ops)


def noise_estimates(squared_norm_sum, summed_norm, weight, micro_batches,
                    ops):
    """One window's unbiased estimates of tr(Sigma) and |G|^2.

    McCandlish et al. (2018), for micro-batches of unequal size: with A the
    sum over micro-batches of v |g_v|^2 (`squared_norm_sum`, v the
    micro-batch's weight and g_v its mean gradient) and W the window's
    weight, A - |sum v g|^2/W estimates (m - 1) tr(Sigma) and
    |sum v g|^2/W - A/m estimates W (1 - 1/m) |G|^2.

    Args:
        squared_norm_sum: Float32, A.
        summed_norm: Float32, |sum v g|^2 (`summed` over the window).
        weight: Float32, W.
        micro_batches: Float32, m, the micro-batches with data.

    Returns:
        (trace, signal), float32.
    """
    m = micro_batches
    window_term = divide_no_nan(summed_norm, weight, ops)
    trace = divide_no_nan(squared_norm_sum - window_term, m - 1.0, ops)
    signal = divide_no_nan(
        (window_term - divide_no_nan(squared_norm_sum, m, ops)) * m,
        weight * (m - 1.0), ops,
    )
    return trace, signal


def noise_scale(trace_sum, signal_sum, estimates):
    """The epoch's B_noise from its windows' summed estimates (floats).

    None when no window was measured; 0.0 when the noise estimate is not
    positive; inf when the signal estimate is not positive (the gradient is
    noise at every batch size the windows hold).
    """
    if estimates == 0.0:
        return None
    if signal_sum <= 0.0:
        return float("inf")
    return max(trace_sum, 0.0) / signal_sum


def loss_of_part(loss_sum, weight_sum, divide_by_weight):
    """The loss of some of a window's micro-batches as one batch (floats):
    their weighted loss sum over their weight (0 where that is 0)."""
    if not divide_by_weight:
        return loss_sum
    return loss_sum / weight_sum if weight_sum else 0.0
