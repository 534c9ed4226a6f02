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

Every call's channels sit side by side in one buffer, and the window adds
and moves them all with one set of operations: what a network's first
`fit()` traces and optimises grows by a few operations per normalization
layer (its reads and assigns), not by a few dozen.
"""

import numpy as np
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
        count: Float32 tensor, [channels] or a scalar for every channel:
            the elements each channel's statistics were taken over on this
            replica.
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

    Attributes:
        sums: The per-replica variable [3, channels of every call] (rows:
            count, sum of (x - moving mean), sum of its square; each call's
            channels after the previous call's), or None without calls.
    """

    def __init__(self, calls, strategy):
        self.calls = list(calls)
        self.channels = [call.channels for call in self.calls]
        self.sums = None
        if self.calls:
            with strategy.scope():
                self.sums = tf.Variable(
                    tf.zeros([3, sum(self.channels)], tf.float32),
                    trainable=False,
                    synchronization=_ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                    name="window_statistics",
                )
        self._rounds = _rounds(self.calls)
        self._call_of_channel = np.repeat(
            np.arange(len(self.calls), dtype=np.int32), self.channels)

    def matches(self, calls):
        calls = list(calls)
        return len(calls) == len(self.calls) and all(
            a.is_same_as(b) for a, b in zip(calls, self.calls)
        )

    @property
    def call_shapes(self):
        """The shape of each call's sums, [3, channels], in call order."""
        return [(3, channels) for channels in self.channels]

    @property
    def names(self):
        """The layer name of each call, in call order."""
        return [call.name for call in self.calls]

    def saved_sums(self):
        """The sums as checkpoints take them: one [3, channels] array per
        call (eagerly, in cross-replica context: summed over replicas)."""
        if self.sums is None:
            return []
        return np.split(self.sums.read_value().numpy(),
                        np.cumsum(self.channels)[:-1], axis=1)

    def joined(self, per_call):
        """`saved_sums()`'s layout back as one array shaped like `sums`."""
        return np.concatenate(per_call, axis=1)

    def add_micro_batch(self, recorded):
        """Adds a micro-batch's statistics (replica context).

        Args:
            recorded: List of `RecordedStatistics`, one per call, in order.
        """
        if self.sums is None:
            return
        recorded = list(recorded)
        counts = [_float32(record.count) for record in recorded]
        if all(count.shape.rank == 0 for count in counts):
            # One count per call, spread over its channels in one gather.
            count = tf.gather(tf.stack(counts), self._call_of_channel)
        else:
            count = tf.concat([
                tf.broadcast_to(count, [record.call.channels])
                for count, record in zip(counts, recorded)], 0)
        mean = tf.concat([_float32(record.mean) for record in recorded], 0)
        variance = tf.concat([_float32(record.variance)
                              for record in recorded], 0)
        shift = tf.concat([_float32(record.call.mean_variable)
                           for record in recorded], 0)
        self.sums.assign_add(tf.stack(arithmetic.statistics_terms(
            count, mean, variance, shift, TF_OPS)))

    @property
    def size(self):
        """The number of floats `local_sums()` holds."""
        return 3 * sum(self.channels)

    def local_sums(self):
        """Float32 vector of this replica's sums, for the window's reduction."""
        if self.sums is None:
            return tf.zeros([0], tf.float32)
        return tf.reshape(self.sums, [-1])

    def apply(self, summed):
        """Moves each call's moving statistics once, by its pooled ones.

        Replica context; every replica computes the same values from the
        summed vector, so no further communication is needed. Calls are
        applied in order, as one step of the large batch would: a layer
        called twice moves a second time from where its first call left it.

        Args:
            summed: Float32 vector, `local_sums()` summed over replicas.
        """
        # Every call's sums were shifted by the moving mean as the window
        # found it; read all before a call of the same layer moves it.
        shift = tf.concat(
            [_float32(call.mean_variable) for call in self.calls], 0)
        sums = tf.reshape(summed, [3, -1])
        for round_index, (columns, calls) in enumerate(self._rounds):
            def taken(values):
                return (values if columns is None
                        else tf.gather(values, columns, axis=-1))

            count, shifted_sum, shifted_square_sum = tf.unstack(taken(sums))
            momentum = np.concatenate([
                np.full([call.channels], call.momentum, np.float32)
                for call in calls])
            complement = np.concatenate([
                np.full([call.channels], 1.0 - call.momentum, np.float32)
                for call in calls])
            # The first round finds the moving means as `shift` read them.
            moving_mean = taken(shift) if round_index == 0 else tf.concat(
                [_float32(call.mean_variable) for call in calls], 0)
            moving_variance = tf.concat(
                [_float32(call.variance_variable) for call in calls], 0)
            mean, variance = arithmetic.pooled_moving_statistics(
                count, shifted_sum, shifted_square_sum, taken(shift),
                moving_mean, moving_variance, momentum, TF_OPS,
                complement=complement)
            widths = [call.channels for call in calls]
            for call, call_mean, call_variance in zip(
                    calls, tf.split(mean, widths), tf.split(variance, widths)):
                call.mean_variable.assign(
                    tf.cast(call_mean, call.mean_variable.dtype))
                call.variance_variable.assign(
                    tf.cast(call_variance, call.variance_variable.dtype))

    def reset(self):
        if self.sums is not None:
            self.sums.assign(tf.zeros_like(self.sums))


def _float32(value):
    return tf.cast(tf.convert_to_tensor(value), tf.float32)


def _rounds(calls):
    """The calls in rounds that can move together: the first call of each
    layer, then the second calls of layers called twice, and so on.

    Returns:
        List of `(columns, calls)`: the round's columns of the window's
        sums (None for all of them, in order) and its calls.
    """
    rounds = []
    seen = []
    offset = 0
    for call in calls:
        index = sum(1 for earlier in seen
                    if earlier.mean_variable is call.mean_variable
                    or earlier.variance_variable is call.variance_variable)
        seen.append(call)
        if index == len(rounds):
            rounds.append(([], []))
        columns, members = rounds[index]
        columns.extend(range(offset, offset + call.channels))
        members.append(call)
        offset += call.channels
    if len(rounds) == 1:
        return [(None, rounds[0][1])]
    return [(np.asarray(columns, np.int32), members)
            for columns, members in rounds]
