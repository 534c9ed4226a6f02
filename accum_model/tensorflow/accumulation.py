"""The accumulation a model holds on TensorFlow: the window's life cycle.

`TensorFlowAccumulation` holds the window's per-replica variables
(`window`) and its end (`window_end`), which run `core.window`'s
transitions. The model (the layer above) passes in what Keras decides (the
strategy, the trainable variables, the compiled optimizer's duties) and
asks it to add a micro step, start an epoch or apply the open window.
"""

import warnings

import tensorflow as tf

from accum_model.core import arithmetic
from accum_model.core import window as core_window
from accum_model.core.lifecycle import WindowLifecycle
from accum_model.core.messages import window_is_open
from accum_model.core.update_signal import UpdateSignal
from accum_model.tensorflow import replicas
from accum_model.tensorflow.ops import TF_OPS
from accum_model.tensorflow.window import GradientWindow
from accum_model.tensorflow.window_end import WindowEnd


class TensorFlowAccumulation(WindowLifecycle):
    """The window state of one model on TensorFlow, and its life cycle:
    `window` is a `GradientWindow`, applied by `window_end`, a `WindowEnd`
    (see `WindowLifecycle` for the rest).

    Args:
        settings: The `Settings` to accumulate with.
    """

    def __init__(self, settings):
        super().__init__(settings)
        self.window_end = None
        self.update_signal = UpdateSignal(self._updates_applied, tf.identity)
        self._run_eagerly = False
        self._report_loss = None
        self._float16_gradients = None

    # What `WindowLifecycle` asks of a backend --------------------------------

    def _window_value(self, name):
        return float(getattr(self.window, name).read_value().numpy())

    def _tracks_loss(self):
        return self.window.tracks_loss

    def _divides_by_weight(self):
        return self.window.divide_by_weight

    def _forget_window(self):
        self.window = None
        self.window_end = None

    def _set_window_length(self, length):
        self.window.set_length(length)

    def _updates_applied(self, optimizer):
        # Under loss scaling the inner optimizer counts the updates (before
        # keras 3.9 the outer one keeps a count of its own).
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        updates = tf.cast(tf.convert_to_tensor(optimizer.iterations),
                          tf.int64)
        scaling = self.loss_scaling
        if (scaling is not None and scaling.counts_skipped_steps
                and self.window is not None):
            skipped = tf.convert_to_tensor(self.window.skipped_windows)
            updates = updates - tf.cast(skipped, tf.int64)
        return updates

    def micro_batch_share(self):
        """Float32 scalar: `arithmetic.micro_batch_share` of one replica's
        micro-batch; 1 before the window exists."""
        window = self.window
        if window is None:
            return tf.constant(1.0)
        return arithmetic.micro_batch_share(
            window.length, window.micro_steps, window.steps_left_in_epoch,
            window.strategy.num_replicas_in_sync, TF_OPS,
            window.divide_by_weight, self.micro_batches_in_step)

    def opens_window(self):
        """Bool scalar: whether the micro step being run is its window's
        first (True before the window exists)."""
        window = self.window
        if window is None:
            return tf.constant(True)
        return tf.equal(window.micro_steps, 0)

    def accumulator_bytes(self):
        """Int. Bytes held by one replica's accumulators."""
        return 0 if self.window is None else self.window.accumulator_bytes

    # Set-up ----------------------------------------------------------------

    def set_up(self, loss_scaling, run_eagerly, report_loss=None,
               float16_gradients=None):
        self.loss_scaling = loss_scaling
        self._run_eagerly = run_eagerly
        self._report_loss = report_loss
        self._float16_gradients = float16_gradients
        if self.window is not None:
            self.window_end = self._make_window_end(self.window)

    def check_window_fits(self, trainable_variables, statistics_calls=None):
        """Refuses to forget gradients when the trainable weights changed.

        After this error the open window is kept as it was, with the
        optimizer and variables it was started with; `apply_open_window()`
        applies it to those and lets training go on with the new ones.
        """
        window = self.window
        if window is None:
            return
        if statistics_calls is None:
            # Before tracing, the calls are the window's own until the
            # forward pass says otherwise.
            statistics_calls = window.statistics.calls
        if window.matches(trainable_variables, statistics_calls):
            return
        open_steps = self.open_micro_steps()
        if open_steps:
            raise ValueError(
                "The model's trainable weights or its training "
                "BatchNormalization layers changed while it had "
                f"{window_is_open(open_steps)}, before changing which "
                "weights are trainable. Received: "
                f"{len(trainable_variables)} trainable variables and "
                f"{len(statistics_calls)} normalization calls, window built "
                f"for {len(window.trainable_variables)} and "
                f"{len(window.statistics.calls)}"
            )

    def ensure_state(self, trainable_variables, strategy,
                     statistics_calls=()):
        """Creates optimizer and window variables for `trainable_variables`.

        Runs in the training step, after the forward pass, because only then
        does every weight exist: a subclassed model creates its weights in
        its first call, and a layer used only in training in its first
        training call. The forward pass also tells which normalization
        layers' moving statistics the window pools (`statistics_calls`).
        """
        variables = list(trainable_variables)
        statistics_calls = list(statistics_calls)
        if not variables:
            # What Keras's own step says; the window then updates nothing.
            warnings.warn("The model does not have any trainable weights.")
        window = self.window
        if (window is not None
                and window.matches(variables, statistics_calls)
                and self.loss_scaling.is_built()):
            return
        replicas.in_cross_replica_context(
            lambda: self._build_state(variables, strategy, statistics_calls)
        )

    def _build_state(self, variables, strategy, statistics_calls):
        with tf.init_scope():
            self.check_window_fits(variables, statistics_calls)
            if not self.loss_scaling.is_built():
                with strategy.scope():
                    self.loss_scaling.build(variables)
            window = self.window
            if window is None or not window.matches(variables,
                                                    statistics_calls):
                self.window = GradientWindow(
                    variables, strategy, self._epoch_steps,
                    length=self.window_length(),
                    accumulator_dtype=tf.as_dtype(
                        self.settings.accumulator_dtype),
                    statistics_calls=statistics_calls,
                    measure_noise_scale=self.settings.measure_noise_scale,
                )
                self.checkpoint.window_built(self.window)
                self.window_end = self._make_window_end(self.window)

    def _make_window_end(self, window):
        float16_gradients = None
        if self.loss_scaling.active and self._float16_gradients is not None:
            float16_gradients = self._float16_gradients(
                window.trainable_variables)
        return WindowEnd(
            window, self.loss_scaling, self._run_eagerly,
            self.settings, self._report_loss, float16_gradients,
        )

    # Training --------------------------------------------------------------

    def start_epoch(self, steps, epoch=None):
        """Called as an epoch begins (None as training ends).

        Args:
            steps: Int. Micro steps in the epoch, or None if unknown.
            epoch: Int. The 0-based epoch, or None to keep the current one.
        """
        self._start_epoch_counts(steps, epoch)
        window = self.window
        if window is not None:
            window.start_epoch(self._epoch_steps, new_epoch=epoch is not None)
            window.set_length(self.window_length())

    def add_micro_batch(self, gradients, weight, batch_size,
                        divide_by_weight=True, loss=None, statistics=(),
                        counts=None, may_end=True):
        """Adds one micro-batch's gradients; ends the window when due.

        Replica context, inside the training step, after `ensure_state`.

        Args:
            gradients: List of unscaled gradients (or None), one per
                trainable variable of the window.
            weight: Float32 scalar. What the micro-batch loss was divided by.
            batch_size: Int scalar. This replica's samples in the step.
            divide_by_weight: Bool. False when every loss term is a sum:
                the window is then the sum of its micro-batches' gradients.
            loss: Scalar, the micro-batch's unscaled loss, whose window mean
                is logged when the window ends; None to log nothing.
            statistics: List of `RecordedStatistics` of the forward pass,
                one per call given to `ensure_state`.
            counts: Whether the micro-batch counts as a micro step; None
                where it does if some replica has data (a batch's later
                micro-batches under `micro_batch_size` do not).
            may_end: Bool. Whether the window may end with this micro-batch
                (False before a batch's last micro-batch; the step then
                calls `end_window_if_due`).

        Returns:
            Bool scalar: whether some replica has data (`counts` where
            given).
        """
        window = self.window
        if len(gradients) != len(window.trainable_variables):
            raise ValueError(
                "Expected one gradient per trainable variable "
                f"({len(window.trainable_variables)}). Received: "
                f"{len(gradients)} gradients"
            )
        window.divide_by_weight = divide_by_weight
        samples = tf.cast(batch_size, tf.float32)
        has_data = counts
        if counts is None:
            has_data = replicas.has_data_on_some_replica(
                samples, window.strategy,
                exact=not self.settings.flush_each_epoch,
            )
        added = window.add_micro_batch(gradients, weight, samples, has_data,
                                       loss, statistics)
        if may_end:
            self.end_window_if_due(has_data, added)
        return has_data

    def end_window_if_due(self, has_data, state=None):
        """Replica context: ends the window where some replica had data
        and it is due (`core.window.ends` of `state`, the window's scalars
        as written, or as read now)."""
        if state is None:
            state = self.window.state(gradient_sums=[])
        self.window_end.end_if(tf.logical_and(has_data,
                                              core_window.ends(state)))

    def apply_open_window(self):
        """Applies the gradients of the window still open, if any."""
        # Nothing is traced for a window that holds nothing (tracing the
        # window's end costs seconds on a large model).
        if self.window_end is None or self.open_micro_steps() == 0:
            return
        self.window_end.apply_open()
