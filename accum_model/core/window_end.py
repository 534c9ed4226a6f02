"""The end of a window: one optimizer update (or a skip), then an empty window.

Written once for replica and cross-replica context (see `replicas`). The
only communication a window costs is here: one small reduction of the
window's weight, samples, finiteness, loss sum, noise-scale estimates and
pooled batch statistics, and the optimizer's reduction of the gradients.
"""

import functools

import tensorflow as tf

from accum_model.core import replicas
from accum_model.core.noise_scale import ESTIMATES


class WindowEnd:
    """Applies, skips or discards the window that `window` holds.

    Args:
        window: The `GradientWindow` being accumulated.
        loss_scaling: The `LossScaling` of the compiled optimizer.
        strategy: The `tf.distribute.Strategy` the model trains under.
        reduce_before_clipping: Bool. Whether the window gradient is summed
            over replicas before the optimizer sees it, so that clipping
            acts on the whole gradient as on one device.
        run_eagerly: Bool. Whether `apply_open` runs without `tf.function`.
        accumulators_may_overflow: Bool. Whether a non-finite window is
            skipped even without loss scaling (narrow accumulators).
        report_loss: Callable `(loss, samples)`, run in replica context for
            each window that saw samples, with the window's loss (the large
            batch's) and the replica's samples in it; or None.
    """

    def __init__(self, window, loss_scaling, strategy, reduce_before_clipping,
                 run_eagerly, accumulators_may_overflow=False,
                 report_loss=None):
        self.window = window
        self.loss_scaling = loss_scaling
        self.strategy = strategy
        self.reduce_before_clipping = reduce_before_clipping
        self.run_eagerly = run_eagerly
        self.checks_finite = loss_scaling.active or accumulators_may_overflow
        self.report_loss = report_loss
        # False for losses reduced with "sum": the window is their sum.
        self.divide_by_weight = True
        self._apply_open_functions = {}

    @classmethod
    def for_window(cls, window, loss_scaling, run_eagerly,
                   accumulators_may_overflow, report_loss=None):
        """The window end of a compiled set-up (see the class's arguments)."""
        strategy = window.strategy
        # Keras 3 clips each replica's gradients before summing them over
        # replicas; to clip the window's gradient as one device would, it is
        # summed first (one more reduction per window, only in this case).
        update_optimizer = loss_scaling.update_optimizer
        reduce_before_clipping = (
            loss_scaling.clips_before_summing_replicas
            and strategy.num_replicas_in_sync > 1
        ) and any(
            getattr(update_optimizer, name, None) is not None
            for name in ("clipnorm", "clipvalue", "global_clipnorm")
        )
        return cls(window, loss_scaling, strategy, reduce_before_clipping,
                   run_eagerly, accumulators_may_overflow, report_loss)

    def end_if(self, should_end):
        """From replica context: ends the window when `should_end` holds."""
        replicas.run_if(should_end, self.end)

    def end(self):
        """Applies the window (or skips it on overflow), then empties it.

        A window that saw no sample on any replica (only steps on empty
        batches at the end of data) is emptied without an update.
        """
        window = self.window
        scaling = self.loss_scaling
        statistics = window.statistics
        noise = window.noise

        def local_totals():
            parts = [tf.stack([
                window.weight_sum, window.sample_sum,
                window.local_is_finite(), window.loss_sum,
            ])]
            if noise is not None:
                parts.append(window.local_noise_estimates())
            parts.append(statistics.local_sums())
            return tf.concat(parts, 0)

        totals = replicas.sum_over_replicas(local_totals)
        noise_end = 4 + (ESTIMATES if noise is not None else 0)
        noise_totals = totals[4:noise_end]
        statistics_totals = totals[noise_end:]
        total_weight, total_samples = totals[0], totals[1]
        if not self.divide_by_weight:
            total_weight = tf.constant(1.0)
        window_loss = tf.math.divide_no_nan(totals[3], total_weight)
        num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
        finite = tf.equal(totals[2], float(num_replicas))

        def update():
            replicas.for_each_replica(self._apply_mean_gradients, total_weight)
            scaling.after_update()
            # Windows skipped for overflow are not measured.
            if noise is not None:
                replicas.for_each_replica(noise.count, noise_totals)

        def skip():
            scaling.after_overflow()
            replicas.for_each_replica(
                lambda: window.skipped_windows.assign_add(1)
            )

        def update_or_skip():
            if self.checks_finite:
                tf.cond(finite, replicas.without_result(update),
                        replicas.without_result(skip))
            else:
                update()

        def report_and_apply():
            # Logged whether the window is applied or skipped for overflow,
            # as Keras logs the loss of a large batch it skips.
            if self.report_loss is not None and window.tracks_loss:
                replicas.for_each_replica(
                    lambda: self.report_loss(window_loss,
                                             window.sample_sum.value())
                )
            # The large batch's forward pass moves the moving statistics
            # whether or not its update is then skipped for overflow.
            if statistics.calls:
                replicas.for_each_replica(statistics.apply, statistics_totals)
            update_or_skip()

        tf.cond(total_samples > 0, replicas.without_result(report_and_apply),
                replicas.do_nothing)
        replicas.for_each_replica(window.reset)

    def _apply_mean_gradients(self, total_weight):
        """Replica context: hands the window gradient to the optimizer."""
        window = self.window
        gradients = window.mean_gradients(total_weight)
        if self.reduce_before_clipping:
            gradients = replicas.summed_into_first_replica(gradients)
        pairs = [
            (g, v)
            for g, v in zip(gradients, window.trainable_variables)
            if g is not None
        ]
        if not pairs:
            return
        self.loss_scaling.apply([g for g, _ in pairs], [v for _, v in pairs])

    def apply_open(self):
        """Applies the window if it holds micro steps (eagerly called)."""
        # Which variables receive gradients is fixed when a function is
        # traced, so there is one traced function per such set.
        key = tuple(self.window.has_gradient)
        function = self._apply_open_functions.get(key)
        if function is None:
            function = self._make_apply_open()
            self._apply_open_functions[key] = function
        function()

    def _make_apply_open(self):
        # A partial, unlike a closure, has no code object of its own, so
        # TensorFlow counts each model's traces apart and does not warn of
        # retracing when many models are trained in one process.
        apply_open_window = functools.partial(_apply_open_window, self)
        if self.run_eagerly:
            return apply_open_window
        return tf.function(apply_open_window)


def _apply_open_window(window_end):
    window_end.strategy.run(
        lambda: window_end.end_if(window_end.window.micro_steps > 0)
    )

