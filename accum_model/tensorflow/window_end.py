"""The end of a window: one optimizer update (or a skip), then an empty window.

Written once for replica and cross-replica context (see `replicas`). The
only communication a window costs is here: one reduction of the window's
gradient sums together with its weight, samples, loss sum, noise-scale
estimates and pooled batch statistics. The window's end checks
(`core.window.end_checks`) then judge the summed window on every replica
alike, with no further communication, and `core.window.ended` says what
follows: this store carries it out in its variables.
"""

import contextlib
import functools

import tensorflow as tf

from accum_model.core import window as core_window
from accum_model.tensorflow import replicas
from accum_model.tensorflow.ops import TF_OPS


class WindowEnd:
    """Applies, skips or discards the window that `window` holds.

    Args:
        window: The `GradientWindow` being accumulated.
        loss_scaling: The `LossScaling` of the compiled optimizer.
        run_eagerly: Bool. Whether `apply_open` runs without `tf.function`.
        settings: The model's `Settings` (what the window's end checks
            follows from them: `core.window.end_checks`).
        report_loss: Callable `(loss, samples)`, run in replica context for
            each window that saw samples, with the window's loss (the large
            batch's) and its samples on all replicas; or None.
        float16_gradients: For each trainable variable, whether the large
            batch's gradient of it is float16 (`WindowConfig.float16`); or
            None.
    """

    def __init__(self, window, loss_scaling, run_eagerly,
                 settings, report_loss=None,
                 float16_gradients=None):
        self.window = window
        self.loss_scaling = loss_scaling
        self.strategy = window.strategy
        self.run_eagerly = run_eagerly
        self.checks = core_window.end_checks(loss_scaling.active, settings)
        self.report_loss = report_loss
        self.float16_gradients = float16_gradients
        self._apply_open_functions = {}

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
        measures_noise = window.measure_noise_scale
        config = window.config(self.float16_gradients or ())
        summed_sums = window.summed_gradient_sums()
        # One collective carries one dtype: float32, or float64 where an
        # accumulator is (narrower accumulators are summed in float32).
        dtype = tf.float64 if any(
            s.dtype == tf.float64 for s in summed_sums) else tf.float32

        noise_end = 3 + (3 if measures_noise else 0)
        totals_size = noise_end + statistics.size

        def local_window():
            state = window.state()
            parts = [tf.stack([
                state.weight_sum, state.sample_sum, state.loss_sum])]
            if measures_noise:
                with tf.name_scope("noise_scale"):
                    parts.append(tf.stack(core_window.window_estimates(
                        config, state, TF_OPS)))
            parts.append(statistics.local_sums())
            totals = tf.cast(tf.concat(parts, 0), dtype)
            return totals, [tf.cast(s, dtype) for s in summed_sums]

        def flat_local_window():
            # One flat tensor: a list would travel as one collective per
            # tensor under some strategies.
            totals, sums = local_window()
            return tf.concat([totals] + [tf.reshape(s, [-1]) for s in sums],
                             0)

        if self.strategy.num_replicas_in_sync == 1:
            # Nothing crosses: the sums are used as they are, without the
            # flat copy a collective needs.
            local_totals, gradient_totals = replicas.for_each_replica(
                local_window)
            totals = replicas.first_local(local_totals)
        else:
            # The window's only collective: its totals and gradient sums.
            reduced = replicas.sum_on_each_replica(flat_local_window)
            totals = replicas.first_local(reduced)[:totals_size]
            gradient_totals = replicas.for_each_replica(
                _split_gradient_totals, reduced, totals_size, summed_sums)
        totals = tf.cast(totals, tf.float32)
        noise_totals = tf.unstack(totals[3:noise_end])
        statistics_totals = totals[noise_end:]
        total_samples = totals[1]

        # The window summed over replicas, as a `WindowState`.
        whole_totals = window.state(gradient_sums=[])._replace(
            weight_sum=totals[0], sample_sum=total_samples,
            loss_sum=totals[2])

        def whole_window(gradient_totals):
            return whole_totals._replace(
                gradient_sums=window.with_summed(gradient_totals))

        verdict = True
        if self.checks:
            # Every replica holds the same summed window (a variable Keras
            # overwrites keeps its own, but those come with float8, which
            # is refused under replicas): the checks need no communication.
            loss_scale = scaling.current_scale() if scaling.active else None
            verdict = replicas.first_local(replicas.for_each_replica(
                lambda sums: core_window.passes(
                    self.checks, config, whole_window(sums), loss_scale,
                    TF_OPS),
                gradient_totals))
        # On one replica a window ends only at a micro step with samples
        # (its own), so it has some; across replicas a window of empty
        # steps alone is discarded. Where that is known, no condition is
        # traced: each one captures what it touches again.
        end = core_window.ended(
            config, whole_totals, TF_OPS, verdict,
            has_samples=(True if self.strategy.num_replicas_in_sync == 1
                         else total_samples > 0),
            estimates=noise_totals if measures_noise else None)

        def report_and_move_statistics():
            if self.report_loss is not None and window.tracks_loss:
                # Every replica reports the whole window, by all its
                # samples: one device's loss whether Keras's tracker sums
                # the replicas or reads the first one's (keras 3.6).
                window_loss = core_window.loss(config, whole_totals, TF_OPS)
                replicas.for_each_replica(
                    lambda: self.report_loss(window_loss, total_samples))
            if statistics.calls:
                replicas.for_each_replica(statistics.apply, statistics_totals)

        def update():
            with (scaling.summed_gradients()
                  if scaling.applies_summed_gradients
                  else contextlib.nullcontext()):
                replicas.for_each_replica(
                    lambda sums: self._apply_window_gradient(
                        config, whole_window(sums)), gradient_totals)
            scaling.after_update()

        # Side by side rather than nested, for the same reason.
        _run_when(end.reports, report_and_move_statistics)
        _run_when(end.applies, update)
        _run_when(end.skips, scaling.after_overflow)
        replicas.for_each_replica(
            lambda: window.reset(end.next_state, whole_totals))

    def _apply_window_gradient(self, config, whole_window):
        """Replica context: hands the window gradient to the optimizer.

        Every replica holds the whole window gradient. Where the optimizer
        can be told so, each applies it without the optimizer's own sum over
        replicas (no second collective, and clipping acts on the whole
        gradient, as on one device). Otherwise the first replica hands in
        the gradient and the others zeros, which the optimizer's sum turns
        into the whole gradient again (clipping a zero leaves a zero).
        """
        window = self.window
        gradients = core_window.mean_gradients(
            config, whole_window,
            [tf.as_dtype(v.dtype).name for v in window.trainable_variables],
            TF_OPS)
        pairs = [
            (g, v, overwrite)
            for g, v, overwrite in zip(
                gradients, window.trainable_variables, window.overwrite)
            if g is not None
        ]
        if not pairs:
            return
        if (not self.loss_scaling.gradients_are_summed
                and self.strategy.num_replicas_in_sync > 1):
            is_first = replicas.is_first_replica()
            pairs = [
                (g if overwrite else g * tf.cast(is_first, g.dtype), v, None)
                for g, v, overwrite in pairs
            ]
        self.loss_scaling.apply([g for g, _, _ in pairs],
                                [v for _, v, _ in pairs])

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
        # retracing when many models are trained in one process. Its body
        # takes its branches with `tf.cond` itself: without AutoGraph,
        # whose conversion of the partial, after some hundred models in
        # one process, returned a `tf.function` from the trace (a
        # TypeError; TensorFlow 2.21, Keras 3 and tf-keras).
        apply_open_window = functools.partial(_apply_open_window, self)
        if self.run_eagerly:
            return apply_open_window
        return tf.function(apply_open_window, autograph=False)


def _apply_open_window(window_end):
    window_end.strategy.run(
        lambda: window_end.end_if(window_end.window.micro_steps > 0)
    )


def _run_when(predicate, fn):
    """Runs `fn()` where the bool tensor `predicate` holds; always where it
    is Python's True, never where it is False."""
    if predicate is True:
        fn()
    elif predicate is not False:
        tf.cond(predicate, replicas.without_result(fn), replicas.do_nothing)


def _split_gradient_totals(reduced, start, summed_sums):
    """Replica context: the gradient sums in `reduced` from `start` on, each
    shaped like its accumulator."""
    result = []
    for gradient_sum in summed_sums:
        size = int(gradient_sum.shape.num_elements())
        result.append(tf.reshape(reduced[start:start + size],
                                 gradient_sum.shape))
        start += size
    return result
