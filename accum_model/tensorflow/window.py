"""Per-replica gradient accumulators and the counters of the open window."""

import tensorflow as tf

from accum_model.core import arithmetic
from accum_model.core.variables import is_overwritten_with_gradient
from accum_model.core.variables import short_name
from accum_model.tensorflow import replicas
from accum_model.tensorflow.batch_statistics import WindowStatistics
from accum_model.tensorflow.noise_scale import NoiseScale
from accum_model.tensorflow.ops import TF_OPS

_ON_READ = tf.VariableSynchronization.ON_READ


class GradientWindow:
    """The state of the window being accumulated, one copy per replica.

    Accumulators are float32 whatever the compute dtype, unless
    `accumulator_dtype` says otherwise. They are
    synchronised on read: each replica adds its own gradients without any
    communication, and the window end reduces them once. Counters are equal
    on all replicas, so each replica keeps its own copy and reading one in
    cross-replica context returns the first replica's.

    A micro step counts only when its micro-batch holds data: Keras and
    `tf.distribute` can run a step on an empty batch when data of unknown
    length runs out. The window also counts its samples, summed over
    replicas when it ends, so that a window of such empty steps alone is
    never applied.

    The variables are not tracked by Keras, so they stay out of
    `model.weights`; checkpoints carry them through `checkpoint`.

    Args:
        trainable_variables: List of the model's trainable variables, in the
            order gradients will be given.
        strategy: The `tf.distribute.Strategy` the model trains under.
        steps_left_in_epoch: Int. Micro steps until the current epoch ends,
            or -1 when unknown.
        length: Int. Micro steps in a window.
        accumulator_dtype: `tf.DType` the gradients are summed in.
        statistics_calls: List of `StatisticsCall`: the normalization
            layers' training-mode calls whose moving statistics the window
            pools (see `batch_statistics`).
        measure_noise_scale: Bool. Whether the window measures the gradient
            noise scale (`noise` is a `NoiseScale`; None otherwise, and the
            step holds no variable or op of it).
    """

    def __init__(self, trainable_variables, strategy, steps_left_in_epoch=-1,
                 length=1, accumulator_dtype=tf.float32, statistics_calls=(),
                 measure_noise_scale=False):
        self.trainable_variables = list(trainable_variables)
        self.strategy = strategy
        # Which variables received a gradient, learned when the training
        # step is traced; variables without one are never updated.
        self.has_gradient = [False] * len(self.trainable_variables)
        # Whether micro steps hand in their loss (the built-in training step
        # does; a step of the user's own reports its loss itself).
        self.tracks_loss = False
        # Variables Keras overwrites with their "gradient" (float8 amax
        # histories and scales): the window keeps the largest value of its
        # micro steps, as Keras's own gradient accumulation does.
        self.overwrite = [
            is_overwritten_with_gradient(v) for v in self.trainable_variables
        ]
        with strategy.scope():
            self.gradient_sums = [
                tf.Variable(
                    tf.zeros(
                        variable.shape,
                        tf.float32 if overwrite else accumulator_dtype,
                    ),
                    trainable=False,
                    synchronization=_ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                    name=f"accumulated_{short_name(variable)}",
                )
                for variable, overwrite in zip(
                    self.trainable_variables, self.overwrite
                )
            ]
            scalar = replicas.local_scalar
            self.weight_sum = scalar("window_weight", tf.float32, "sum")
            # The micro-batches' losses, each times its weight: divided by
            # the window's weight, the large batch's loss.
            self.loss_sum = scalar("window_loss", tf.float32, "sum")
            self.sample_sum = scalar("window_samples", tf.float32, "sum")
            self.micro_steps = scalar("window_micro_steps", tf.int64)
            # Micro steps left before the epoch ends; negative when unknown.
            self.steps_left_in_epoch = scalar(
                "steps_left_in_epoch", tf.int64, initial=steps_left_in_epoch
            )
            self.skipped_windows = scalar("skipped_windows", tf.int64)
            # The length of this window, and of the windows after it (a
            # schedule changes it at a window boundary).
            self.length = scalar("window_length", tf.int64, initial=length)
            self.next_length = scalar("next_window_length", tf.int64,
                                      initial=length)
        self.statistics = WindowStatistics(statistics_calls, strategy)
        self.noise = NoiseScale(strategy) if measure_noise_scale else None

    def matches(self, trainable_variables, statistics_calls=()):
        """Whether this window was built for exactly these variables."""
        current = list(trainable_variables)
        return len(current) == len(self.trainable_variables) and all(
            a is b for a, b in zip(current, self.trainable_variables)
        ) and self.statistics.matches(statistics_calls)

    @property
    def accumulator_bytes(self):
        """Bytes held by one replica's accumulators."""
        return sum(
            s.dtype.size * int(s.shape.num_elements())
            for s in self.gradient_sums
        )

    def add(self, gradients, weight, samples, counts, loss=None,
            statistics=(), divided=True):
        """Adds a micro step to the window (replica context).

        Args:
            gradients: List of gradients (or None), one per variable.
            weight: Float32 scalar, the micro-batch's share of the window:
                its gradients are added multiplied by it.
            samples: Float32 scalar, this replica's samples in the step.
            counts: Bool scalar, whether the step counts as a micro step
                (the micro-batch has data on some replica). Equal on all
                replicas.
            loss: Scalar, the micro-batch's loss, or None if not tracked.
            statistics: List of `RecordedStatistics`, one per statistics
                call of the window.
            divided: Bool. Whether the loss was a mean over `weight`
                elements (False: a sum, see `NoiseScale.add`).
        """
        # A variable keeps its gradient once any micro step gave it one (in
        # eager mode each step reports its own; a trace reports them all).
        self.has_gradient = [
            used or g is not None
            for used, g in zip(self.has_gradient, gradients)
        ]
        for gradient_sum, gradient, overwrite in zip(
            self.gradient_sums, gradients, self.overwrite
        ):
            if gradient is None:
                continue
            dtype = gradient_sum.dtype
            if overwrite:
                value = tf.cast(gradient, tf.float32)
                first = tf.equal(self.micro_steps, 0)
                gradient_sum.assign(
                    tf.where(first, value, tf.maximum(gradient_sum, value))
                )
                continue
            if isinstance(gradient, tf.IndexedSlices) and not isinstance(
                gradient_sum, tf.distribute.DistributedValues
            ):
                # Rows are summed into the dense accumulator: the window
                # gradient is the exact gradient of the window's loss.
                # (Synchronised-on-read variables cannot scatter; there the
                # rows are summed into a dense tensor first.)
                gradient_sum.scatter_add(
                    tf.IndexedSlices(
                        _weighted(gradient.values, weight, dtype),
                        gradient.indices,
                        gradient.dense_shape,
                    )
                )
                continue
            gradient_sum.assign_add(_weighted(gradient, weight, dtype))
        self.weight_sum.assign_add(weight)
        if loss is not None:
            self.tracks_loss = True
            # A micro-batch of weight 0 (every element masked or ignored)
            # adds nothing, also where its own mean loss is 0/0 (Keras 2).
            self.loss_sum.assign_add(arithmetic.weighted_loss(
                tf.cast(loss, tf.float32), weight, TF_OPS))
        self.sample_sum.assign_add(samples)
        self.statistics.add(statistics)
        if self.noise is not None:
            self.noise.add(
                [None if overwrite else g
                 for g, overwrite in zip(gradients, self.overwrite)],
                weight, samples, divided,
            )
        step = tf.cast(counts, tf.int64)
        self.micro_steps.assign_add(step)
        self.steps_left_in_epoch.assign_sub(step)

    def set_length(self, length):
        """Sets the window length from the next window boundary (eagerly).

        An empty window takes it at once; an open one keeps its own length.
        """
        self.next_length.assign(length)
        if int(self.micro_steps.numpy()) == 0:
            self.length.assign(length)

    def is_full(self):
        return self.micro_steps >= self.length

    def local_is_finite(self):
        """1.0 if this replica's accumulators are all finite, else 0.0."""
        finite = [
            tf.reduce_all(tf.math.is_finite(s))
            for s, used in zip(self.gradient_sums, self.has_gradient)
            if used
        ]
        if not finite:
            return tf.constant(1.0)
        return tf.cast(tf.reduce_all(tf.stack(finite)), tf.float32)

    def summed_gradient_sums(self):
        """The accumulators summed over replicas when the window ends: those
        of variables with a gradient, but not those Keras overwrites with
        their gradient (each replica keeps its own largest value)."""
        return self.of_summed(self.gradient_sums)

    def of_summed(self, per_variable):
        """The entries of `per_variable` (one per trainable variable) that
        belong to `summed_gradient_sums()`, in its order."""
        return [
            item for item, used, overwrite in zip(
                per_variable, self.has_gradient, self.overwrite)
            if used and not overwrite
        ]

    def local_noise_estimates(self):
        """This replica's noise-scale estimates (see `NoiseScale`)."""
        return self.noise.local_estimates(self.summed_gradient_sums())

    def mean_gradients(self, total_weight, summed):
        """The window gradient (replica context).

        Args:
            total_weight: Float32 scalar, the window's weight summed over
                replicas.
            summed: List of tensors, the sums over replicas of
                `summed_gradient_sums()`, in that order.

        Returns:
            One entry per variable: the weighted mean gradient of the whole
            window, this replica's own value where Keras overwrites the
            variable with its gradient, None where there is no gradient. A
            window whose weight is zero (every element masked) has a zero
            gradient, as Keras's `divide_no_nan` gives the large batch.
        """
        summed = iter(summed)
        result = []
        for gradient_sum, variable, used, overwrite in zip(
            self.gradient_sums, self.trainable_variables,
            self.has_gradient, self.overwrite,
        ):
            if not used:
                result.append(None)
            elif overwrite:
                result.append(tf.cast(gradient_sum, variable.dtype))
            else:
                total = next(summed)
                result.append(tf.cast(
                    arithmetic.divide_no_nan(
                        total, tf.cast(total_weight, total.dtype), TF_OPS),
                    variable.dtype,
                ))
        return result

    def reset(self):
        """Empties the window (replica context)."""
        for gradient_sum in self.gradient_sums:
            gradient_sum.assign(tf.zeros_like(gradient_sum))
        self.weight_sum.assign(0.0)
        self.loss_sum.assign(0.0)
        self.sample_sum.assign(0.0)
        self.statistics.reset()
        if self.noise is not None:
            self.noise.reset()
        self.micro_steps.assign(0)
        self.length.assign(self.next_length)
        if tf.executing_eagerly():
            # Eager steps report gradients one micro step at a time; a trace
            # has already seen every variable that can receive one.
            self.has_gradient = [False] * len(self.has_gradient)


def _weighted(gradient, weight, dtype):
    """`gradient * weight` in `dtype` (in float32 first when narrower)."""
    wide = tf.float64 if dtype == tf.float64 else tf.float32
    return tf.cast(tf.cast(gradient, wide) * tf.cast(weight, wide), dtype)

