"""The gradient noise scale, measured from the windows training runs anyway.

A window holds n micro-batch gradients and their weighted sum. For a batch
of B samples drawn from the data, E|g_B|^2 = |G|^2 + tr(Sigma)/B, with G the
true gradient and Sigma the per-sample gradient covariance. Two batch sizes
give two equations in two unknowns: McCandlish et al., "An Empirical Model
of Large-Batch Training" (2018, appendix A), solve them for unbiased
estimates of |G|^2 and tr(Sigma). Their ratio B_noise = tr(Sigma)/|G|^2 is
the batch size above which a larger batch mostly wastes compute.

Here the small batches are a replica's micro-batches, each of size v (what
its loss was divided by; see `divisor`), and the large batch is that
replica's window: W = sum(v), A = sum(v |g|^2) over its m micro-batches,
C = |sum(v g)|^2. Then

    E[A - C/W] = (m - 1) tr(Sigma)   and   E[C/W - A/m] = W (1 - 1/m) |G|^2,

for micro-batches of any sizes (a short last one included). Each replica's
window is measured on its own, so that nothing but three scalars per replica
joins the window's one reduction. An epoch's `noise_scale` is the ratio of
its windows' summed estimates, not a mean of ratios, which would be biased
and can divide by about zero.
"""

import tensorflow as tf

from accum_model.core import arithmetic
from accum_model.tensorflow.ops import TF_OPS
from accum_model.tensorflow import replicas

# Number of values `local_estimates` adds to the window's reduction.
ESTIMATES = 3


class NoiseScale:
    """Per-replica sums of a window, and the epoch's summed estimates.

    Args:
        strategy: The `tf.distribute.Strategy` the model trains under.
    """

    def __init__(self, strategy):
        float32 = tf.float32
        with strategy.scope():
            # This replica's window: sum of v |g|^2, sum of v, and the
            # micro-batches with v > 0 in it.
            self.squared_norm_sum = replicas.local_scalar(
                "noise_squared_norm_sum", float32, "sum")
            self.weight_sum = replicas.local_scalar(
                "noise_weight_sum", float32, "sum")
            self.micro_batches = replicas.local_scalar(
                "noise_micro_batches", float32, "sum")
            # 0 for a window whose first micro-batches no longer are in
            # these sums (restored from a checkpoint): it is not measured.
            self.measurable = replicas.local_scalar(
                "noise_window_measurable", float32, "sum", initial=1.0)
            # The epoch's estimates of tr(Sigma) and |G|^2, summed over
            # measured (window, replica) pairs, and how many there were;
            # equal on all replicas.
            self.trace_sum = replicas.local_scalar("noise_trace_sum", float32)
            self.signal_sum = replicas.local_scalar("noise_signal_sum",
                                                    float32)
            self.estimates = replicas.local_scalar("noise_estimates", float32)

    def add(self, gradients, weight, samples, divided):
        """Adds a micro-batch's squared gradient norm (replica context).

        Args:
            gradients: List of the gradients the window adds (or None).
            weight: Float32 scalar, what the window multiplies them by.
            samples: Float32 scalar, the micro-batch's samples.
            divided: Bool. Whether the loss was divided by `weight` (a mean
                over `weight` elements); False for a sum over samples, whose
                mean gradient is then the gradient over `samples`.
        """
        with tf.name_scope("noise_scale"):
            squared_norm = tf.add_n(
                [_squared_norm(g) for g in gradients if g is not None]
                or [tf.constant(0.0)]
            )
            size = weight if divided else samples
            self.squared_norm_sum.assign_add(arithmetic.noise_micro_batch_term(
                weight, squared_norm, size, TF_OPS))
            self.weight_sum.assign_add(size)
            self.micro_batches.assign_add(tf.cast(size > 0, tf.float32))

    def local_estimates(self, gradient_sums):
        """This replica's window estimates, for the window's reduction.

        Args:
            gradient_sums: List of this replica's accumulated gradients
                (sum of v g per variable) that count in the norm.

        Returns:
            Float32 vector [tr(Sigma), |G|^2, 1], or zeros when the window
            cannot be measured (fewer than two micro-batches with data).
        """
        with tf.name_scope("noise_scale"):
            summed_norm = tf.add_n(
                [tf.reduce_sum(tf.square(tf.cast(s, tf.float32)))
                 for s in gradient_sums] or [tf.constant(0.0)]
            )
            m = tf.convert_to_tensor(self.micro_batches)
            weight = tf.convert_to_tensor(self.weight_sum)
            squared_norm_sum = tf.convert_to_tensor(self.squared_norm_sum)
            measured = tf.logical_and(
                m >= 2.0, tf.convert_to_tensor(self.measurable) > 0.0
            )
            trace, signal = arithmetic.noise_estimates(
                squared_norm_sum, summed_norm, weight, m, TF_OPS)
            return tf.where(measured, tf.stack([trace, signal, 1.0]),
                            tf.zeros([ESTIMATES]))

    def count(self, summed):
        """Adds a window's estimates, summed over replicas, to the epoch's.

        Replica context; every replica holds the same sums.
        """
        self.trace_sum.assign_add(summed[0])
        self.signal_sum.assign_add(summed[1])
        self.estimates.assign_add(summed[2])

    def reset(self):
        """Empties the window's sums (replica context)."""
        for variable in (self.squared_norm_sum, self.weight_sum,
                         self.micro_batches):
            variable.assign(0.0)
        self.measurable.assign(1.0)

    def window_restored(self, is_open):
        """Empties the window's sums after a checkpoint restored the window
        (eagerly). A restored open window is not measured: its micro-batches
        before the checkpoint are not in the sums."""
        for variable in (self.squared_norm_sum, self.weight_sum,
                         self.micro_batches):
            replicas.assign_on_every_replica(variable, 0.0)
        replicas.assign_on_every_replica(self.measurable,
                                         0.0 if is_open else 1.0)

    def start_epoch(self):
        """Forgets the estimates of the epochs before (eagerly)."""
        for variable in (self.trace_sum, self.signal_sum, self.estimates):
            replicas.assign_on_every_replica(variable, 0.0)

    def epoch_value(self):
        """Float, the epoch's B_noise so far, or None if nothing measured.

        0.0 when the noise estimate is not positive (no noise measurable);
        inf when the estimate of |G|^2 is not positive (the gradient is
        noise at every batch size the windows hold).
        """
        return arithmetic.noise_scale(
            *(float(variable.read_value().numpy()) for variable in (
                self.trace_sum, self.signal_sum, self.estimates)))


def _squared_norm(gradient):
    """Float32 |gradient|^2; the rows of sparse gradients summed first."""
    if isinstance(gradient, tf.IndexedSlices):
        indices, positions = tf.unique(gradient.indices)
        values = tf.math.unsorted_segment_sum(
            tf.cast(gradient.values, tf.float32), positions,
            tf.shape(indices)[0],
        )
        return tf.reduce_sum(tf.square(values))
    return tf.reduce_sum(tf.square(tf.cast(gradient, tf.float32)))
