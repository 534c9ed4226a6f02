"""Moving batch statistics of a window, pooled as the large batch's.

A normalization layer that trains on batch statistics (BatchNormalization)
moves its moving mean and variance by `momentum` once per training step,
from the statistics of the batch it sees. In a window the weights do not
change, so the window's micro-batches together are the large batch cut in
slices: pooling each slice's count, sum and sum of squares per channel gives
the large batch's mean and variance, and one momentum step per window from
them gives the large batch's moving statistics.

The sums are shifted by the moving mean, which stays constant through the
window (the layer's own per-micro-batch updates are suppressed by the
adapter), so that the variance does not cancel catastrophically when the
mean is large. Sums are per replica and reduced with the window's other
totals, in its one reduction.
"""

import tensorflow as tf

from accum_model.core import arithmetic
from accum_model.tensorflow.ops import TF_OPS

_ON_READ = tf.VariableSynchronization.ON_READ


class StatisticsCall:
    """One training-mode call of a normalization layer in the training step.

    Args:
        mean_variable: The layer's moving mean (readable as a tensor, with
            `assign`).
        variance_variable: The layer's moving variance.
        momentum: Float. The layer's momentum.
        name: Str. The layer's name, for the window's variable names.
    """

    def __init__(self, mean_variable, variance_variable, momentum, name):
        self.mean_variable = mean_variable
        self.variance_variable = variance_variable
        self.momentum = float(momentum)
        self.name = name

    @property
    def channels(self):
        return int(self.mean_variable.shape[0])

    def is_same_as(self, other):
        return (self.mean_variable is other.mean_variable
                and self.variance_variable is other.variance_variable
                and self.momentum == other.momentum)


class RecordedStatistics:
    """A micro-batch's statistics at one call: count, mean and variance.

    Args:
        call: The `StatisticsCall` they were recorded at.
        count: Float32 tensor [channels]: the elements each channel's
            statistics were taken over on this replica.
        mean: Float32 tensor [channels], the layer's batch mean.
        variance: Float32 tensor [channels], its (biased) batch variance.
    """

    def __init__(self, call, count, mean, variance):
        self.call = call
        self.count = count
        self.mean = mean
        self.variance = variance


class WindowStatistics:
    """Per-replica sums of the window's batch statistics, call by call.

    Args:
        calls: List of `StatisticsCall`, in the order the step makes them.
        strategy: The `tf.distribute.Strategy` the model trains under.
    """

    def __init__(self, calls, strategy):
        self.calls = list(calls)
        with strategy.scope():
            # Rows: count, sum of (x - moving mean), sum of its square.
            self.sums = [
                tf.Variable(
                    tf.zeros([3, call.channels], tf.float32),
                    trainable=False,
                    synchronization=_ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                    name=f"window_statistics_{call.name}",
                )
                for call in self.calls
            ]

    def matches(self, calls):
        calls = list(calls)
        return len(calls) == len(self.calls) and all(
            a.is_same_as(b) for a, b in zip(calls, self.calls)
        )

    def add(self, recorded):
        """Adds a micro-batch's statistics (replica context).

        Args:
            recorded: List of `RecordedStatistics`, one per call, in order.
        """
        for sums, record in zip(self.sums, recorded):
            shift = tf.cast(tf.convert_to_tensor(record.call.mean_variable),
                            tf.float32)
            sums.assign_add(tf.stack(arithmetic.statistics_terms(
                tf.cast(record.count, tf.float32),
                tf.cast(record.mean, tf.float32),
                tf.cast(record.variance, tf.float32), shift, TF_OPS)))

    @property
    def size(self):
        """The number of floats `local_sums()` holds."""
        return sum(int(s.shape.num_elements()) for s in self.sums)

    def local_sums(self):
        """Float32 vector of this replica's sums, for the window's reduction."""
        if not self.sums:
            return tf.zeros([0], tf.float32)
        return tf.concat([tf.reshape(s, [-1]) for s in self.sums], 0)

    def apply(self, summed):
        """Moves each call's moving statistics once, by its pooled ones.

        Replica context; every replica computes the same values from the
        summed vector, so no further communication is needed. Calls are
        applied in order, as one step of the large batch would.

        Args:
            summed: Float32 vector, `local_sums()` summed over replicas.
        """
        # Every call's sums were shifted by the moving mean as the window
        # found it; read all before a call of the same layer moves it.
        shifts = [
            tf.identity(tf.cast(tf.convert_to_tensor(call.mean_variable),
                                tf.float32))
            for call in self.calls
        ]
        offset = 0
        for call, shift in zip(self.calls, shifts):
            size = 3 * call.channels
            count, shifted_sum, shifted_square_sum = tf.unstack(
                tf.reshape(summed[offset:offset + size], [3, call.channels])
            )
            offset += size
            moving_mean = tf.cast(tf.convert_to_tensor(call.mean_variable),
                                  tf.float32)
            moving_variance = tf.cast(
                tf.convert_to_tensor(call.variance_variable), tf.float32
            )
            mean, variance = arithmetic.pooled_moving_statistics(
                count, shifted_sum, shifted_square_sum, shift, moving_mean,
                moving_variance, call.momentum, TF_OPS)
            call.mean_variable.assign(tf.cast(mean,
                                              call.mean_variable.dtype))
            call.variance_variable.assign(tf.cast(
                variance, call.variance_variable.dtype))

    def reset(self):
        for sums in self.sums:
            sums.assign(tf.zeros_like(sums))
