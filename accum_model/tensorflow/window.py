"""The window's state on TensorFlow: per-replica variables that
`core.window`'s transitions move."""

import tensorflow as tf

from accum_model.core import window as core_window
from accum_model.core.variables import is_overwritten_with_gradient
from accum_model.core.variables import short_name
from accum_model.core.window import WindowConfig
from accum_model.core.window import WindowState
from accum_model.tensorflow import replicas
from accum_model.tensorflow.batch_statistics import WindowStatistics
from accum_model.tensorflow.ops import TF_OPS

_ON_READ = tf.VariableSynchronization.ON_READ

# The state's scalars: (variable name, dtype, aggregation over replicas).
# Sums are each replica's own and add up in cross-replica context; the
# counters are equal on all replicas and read as the first one's.
_SCALARS = {
    "weight_sum": ("window_weight", tf.float32, "sum"),
    # The micro-batches' losses, each times its weight: divided by the
    # window's weight, the large batch's loss.
    "loss_sum": ("window_loss", tf.float32, "sum"),
    "sample_sum": ("window_samples", tf.float32, "sum"),
    "micro_steps": ("window_micro_steps", tf.int64, "first"),
    "steps_left_in_epoch": ("steps_left_in_epoch", tf.int64, "first"),
    "skipped_windows": ("skipped_windows", tf.int64, "first"),
    "length": ("window_length", tf.int64, "first"),
    "next_length": ("next_window_length", tf.int64, "first"),
}
# The noise scale's, made only where it is measured. Each replica's window
# is measured on its own (its micro-batches are the small batches, its
# window the large one), so that only three scalars per replica join the
# window's one reduction.
_NOISE_SCALARS = {
    "noise_squared_norm_sum": ("noise_squared_norm_sum", "sum"),
    "noise_weight_sum": ("noise_weight_sum", "sum"),
    "noise_micro_batches": ("noise_micro_batches", "sum"),
    "noise_measurable": ("noise_window_measurable", "sum"),
    "noise_trace_sum": ("noise_trace_sum", "first"),
    "noise_signal_sum": ("noise_signal_sum", "first"),
    "noise_estimates": ("noise_estimates", "first"),
}


class GradientWindow:
    """The window being accumulated, one copy per replica.

    A store of a `core.window.WindowState`: each field is a variable
    synchronised on read (each replica adds its own micro-batches without
    communication; the window end reduces them once), written with what
    `core.window`'s transitions return. A field the set-up does not use
    (the noise scale's, unmeasured) is a constant, so that the step holds
    no variable or op of it. The variables are not tracked by Keras, so
    they stay out of `model.weights`; checkpoints carry them through
    `checkpoint`.

    Args:
        trainable_variables: The model's trainable variables, in the order
            gradients will be given.
        strategy: The `tf.distribute.Strategy` the model trains under.
        steps_left_in_epoch: Int. Micro steps until the current epoch ends,
            or -1 when unknown.
        length: Int. Micro steps in a window.
        accumulator_dtype: `tf.DType` the gradients are summed in.
        statistics_calls: The `batch_statistics.StatisticsCall`s whose
            moving statistics the window pools.
        measure_noise_scale: Bool. Whether the noise-scale sums move.
    """

    def __init__(self, trainable_variables, strategy, steps_left_in_epoch=-1,
                 length=1, accumulator_dtype=tf.float32, statistics_calls=(),
                 measure_noise_scale=False):
        self.trainable_variables = list(trainable_variables)
        self.strategy = strategy
        self.measure_noise_scale = measure_noise_scale
        # Which variables received a gradient, learned when the training
        # step is traced; variables without one are never updated.
        self.has_gradient = [False] * len(self.trainable_variables)
        # Whether micro steps hand in their loss (the built-in training step
        # does; a step of the user's own reports its loss itself).
        self.tracks_loss = False
        # False where every loss term is a sum: the window is the sum of
        # its micro-batches (set as the step is traced).
        self.divide_by_weight = True
        self.overwrite = [
            is_overwritten_with_gradient(v) for v in self.trainable_variables
        ]
        initial = {"steps_left_in_epoch": steps_left_in_epoch,
                   "length": length, "next_length": length,
                   "noise_measurable": 1.0}
        self.variables = {}
        with strategy.scope():
            self.gradient_sums = [
                tf.Variable(
                    tf.zeros(variable.shape,
                             tf.float32 if kept else accumulator_dtype),
                    trainable=False, synchronization=_ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                    name=f"accumulated_{short_name(variable)}",
                )
                for variable, kept in zip(self.trainable_variables,
                                          self.overwrite)
            ]
            scalars = dict(_SCALARS)
            if measure_noise_scale:
                scalars.update({
                    field: (name, tf.float32, aggregation)
                    for field, (name, aggregation) in _NOISE_SCALARS.items()})
            for field, (name, dtype, aggregation) in scalars.items():
                self.variables[field] = replicas.local_scalar(
                    name, dtype, aggregation, initial=initial.get(field, 0))
        self.statistics = WindowStatistics(statistics_calls, strategy)

    def __getattr__(self, field):
        # The state's scalar variables, by field name.
        variables = self.__dict__.get("variables", {})
        if field in variables:
            return variables[field]
        raise AttributeError(field)

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

    def config(self, float16=()):
        """The `WindowConfig` of the step being traced."""
        return WindowConfig(
            overwrite=tuple(self.overwrite),
            divide_by_weight=self.divide_by_weight,
            measure_noise_scale=self.measure_noise_scale,
            has_gradient=tuple(self.has_gradient), float16=tuple(float16))

    def state(self, gradient_sums=None):
        """The state's current values in this context, with
        `gradient_sums` (default: the accumulators themselves)."""
        values = {field: _read(variable)
                  for field, variable in self.variables.items()}
        for field in _NOISE_SCALARS:
            values.setdefault(field, tf.constant(0.0))
        return WindowState(
            gradient_sums=(self.gradient_sums if gradient_sums is None
                           else gradient_sums),
            statistics_sums=[], learning_rate_scale=tf.constant(1.0),
            **values)

    def write(self, new, old, everywhere=False):
        """Assigns each scalar of `new` that differs from `old` (the state
        it was computed from); `everywhere`: eagerly, every replica's copy
        (cross-replica context)."""
        for field, variable in self.variables.items():
            value = getattr(new, field)
            if value is getattr(old, field):
                continue
            if everywhere:
                replicas.assign_on_every_replica(variable, value)
            else:
                variable.assign(tf.cast(value, variable.dtype))

    def update(self, transition, everywhere=False):
        """Writes `transition(state)` (scalars only)."""
        old = self.state(gradient_sums=[])
        self.write(transition(old), old, everywhere)

    def add_micro_batch(self, gradients, weight, samples, counts,
                        loss=None, statistics=()):
        """Adds a micro step to the window (replica context), as
        `core.window.micro_batch_added` with `statistics` (one
        `RecordedStatistics` per call of the window). `counts`, equal on
        all replicas, is whether the micro-batch has data on some replica:
        `tf.distribute` can run a step on an empty batch when data of
        unknown length runs out. Returns the state's scalars as written.
        """
        # A variable keeps its gradient once any micro step gave it one (in
        # eager mode each step reports its own; a trace reports them all).
        self.has_gradient = [
            used or g is not None
            for used, g in zip(self.has_gradient, gradients)
        ]
        if loss is not None:
            self.tracks_loss = True
        old = self.state(gradient_sums=[])
        first = tf.equal(old.micro_steps, 0)
        for total, gradient, kept in zip(self.gradient_sums, gradients,
                                         self.overwrite):
            if gradient is None:
                continue
            if kept:
                total.assign(core_window.largest(total, gradient, first,
                                                 TF_OPS))
            elif isinstance(gradient, tf.IndexedSlices) and not isinstance(
                    total, tf.distribute.DistributedValues):
                # Rows are summed into the dense accumulator: the window
                # gradient is the exact gradient of the window's loss.
                # (Synchronised-on-read variables cannot scatter; there the
                # rows are summed into a dense tensor first.)
                total.scatter_add(tf.IndexedSlices(
                    core_window.weighted(gradient.values, weight,
                                         total.dtype.name, TF_OPS),
                    gradient.indices, gradient.dense_shape))
            else:
                total.assign_add(core_window.weighted(
                    gradient, weight, total.dtype.name, TF_OPS))
        config = self.config()
        new = core_window.counters_added(
            config._replace(measure_noise_scale=False), old, gradients,
            weight, loss, samples, TF_OPS, counts)
        if self.measure_noise_scale:
            with tf.name_scope("noise_scale"):
                new = core_window.noise_added(config, new, gradients, weight,
                                              samples, TF_OPS)
        self.write(new, old)
        self.statistics.add_micro_batch(statistics)
        return new

    def set_length(self, length):
        """`core.window.with_length`, eagerly."""
        self.update(lambda state: core_window.with_length(state, length,
                                                          TF_OPS),
                    everywhere=True)

    def start_epoch(self, steps_left_in_epoch, new_epoch):
        """`core.window.with_epoch`, eagerly."""
        self.update(lambda state: core_window.with_epoch(
            state, steps_left_in_epoch, TF_OPS, new_epoch), everywhere=True)

    def summed_gradient_sums(self):
        """The accumulators summed over replicas when the window ends: those
        of variables with a gradient, but not those Keras overwrites with
        their gradient (each replica keeps its own largest value)."""
        return [total for total, used, kept in zip(
            self.gradient_sums, self.has_gradient, self.overwrite)
            if used and not kept]

    def with_summed(self, summed):
        """One entry per variable: the sum over replicas from `summed`
        (in `summed_gradient_sums()`'s order) where there is one, else this
        replica's own accumulator."""
        summed = iter(summed)
        return [next(summed) if used and not kept else total
                for total, used, kept in zip(
                    self.gradient_sums, self.has_gradient, self.overwrite)]

    def reset(self, next_state, state):
        """Empties the window (replica context): zero sums, and the scalars
        of `next_state` (`core.window.ended`'s), where they differ from
        `state`, the window's as the end read it."""
        for total in self.gradient_sums:
            total.assign(tf.zeros_like(total))
        self.write(next_state, state)
        self.statistics.reset()
        if tf.executing_eagerly():
            # Eager steps report gradients one micro step at a time; a trace
            # has already seen every variable that can receive one.
            self.has_gradient = [False] * len(self.has_gradient)


def _read(variable):
    """The variable's value here; in cross-replica context the first local
    replica's (no collective: only counters equal on all replicas are read
    there)."""
    if (tf.distribute.in_cross_replica_context()
            and isinstance(variable, tf.distribute.DistributedValues)):
        variable = variable.values[0]
    return tf.convert_to_tensor(variable)
