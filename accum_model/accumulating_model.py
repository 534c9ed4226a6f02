"""The public `AccumulatingModel` class."""

import inspect

import keras
import tensorflow as tf
from keras import tree

from accum_model import _checks
from accum_model import _functional
from accum_model import _keras_private
from accum_model import _loss_divisor
from accum_model import _replicas
from accum_model._accumulator import GradientWindow
from accum_model._loss_scaling import LossScaling
from accum_model._window_callback import WindowCallback


@keras.saving.register_keras_serializable(package="accum_model")
class AccumulatingModel(keras.Model):
    """A `keras.Model` that applies one update per `n_gradients` micro-batches.

    Each call of `train_step` (one micro-batch, one *micro step*) adds the
    micro-batch's gradient to float32 accumulators, weighted by what Keras
    divides that micro-batch's loss by. After `n_gradients` micro steps the
    model applies one optimizer update (one *gradient step*) with the
    weighted mean gradient, which is the gradient of the loss of the
    concatenated micro-batches: n micro-batches of size b train like one
    batch of n*b. Optimizer state, `optimizer.iterations`, learning-rate
    schedules, clipping and weight decay only move on gradient steps.

    The window still open when an epoch ends is applied with the weight of
    what it holds (`flush_each_epoch=True`), or carried on into the next
    epoch and applied when `fit()` returns (`flush_each_epoch=False`).
    Either way no gradient is left unapplied when `fit()` returns.

    Use it like `keras.Model`: functionally,
    `AccumulatingModel(inputs=..., outputs=..., n_gradients=4)`, or as a base
    class whose `__init__` calls `super().__init__(n_gradients=4, **kwargs)`.
    Metrics, the loss in the progress bar and callbacks see every micro
    step. `evaluate()` and `predict()` are those of `keras.Model`.

    Under mixed precision (`LossScaleOptimizer`), each micro step scales its
    loss with `get_scaled_loss` and unscales its gradients with
    `get_unscaled_gradients` before accumulating them. A window in which any
    gradient overflowed, on any replica, is skipped as a whole and lowers
    the loss scale once; `skipped_windows` counts such windows.

    Args:
        n_gradients: Int >= 1. Number of micro-batches whose gradients make
            one update. 1 trains exactly like `keras.Model`.
        flush_each_epoch: Bool. Whether the window open at the end of an
            epoch is applied then (True, the default) or continued in the
            next epoch (False).
        **kwargs: Passed to `keras.Model`.
    """

    def __new__(cls, *args, **kwargs):
        if _functional.is_functional_call(args, kwargs):
            cls = _functional.functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, n_gradients=1, flush_each_epoch=True, **kwargs):
        n_gradients = _checks.check_n_gradients(n_gradients)
        flush_each_epoch = _checks.check_flush_each_epoch(flush_each_epoch)
        super().__init__(*args, **kwargs)
        self.n_gradients = n_gradients
        self.flush_each_epoch = flush_each_epoch
        self._gradient_window = None
        self._epoch_steps = -1
        self._loss_scaling = None
        self._apply_open_window_function = None

    # Configuration ---------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "n_gradients": self.n_gradients,
                "flush_each_epoch": self.flush_each_epoch,
            }
        )
        return config

    # Public state ----------------------------------------------------------

    @property
    def skipped_windows(self):
        """Int. Windows skipped because a gradient overflowed (mixed precision)."""
        if self._gradient_window is None:
            return 0
        return int(self._gradient_window.skipped_windows.numpy())

    @property
    def accumulator_bytes(self):
        """Int. Bytes held by the gradient accumulators of one replica."""
        if self._gradient_window is None:
            return 0
        return self._gradient_window.accumulator_bytes

    # Hooks a subclass may override -----------------------------------------

    def get_scaled_loss(self, loss):
        """Scales a micro-batch loss before its gradients are taken.

        With a `LossScaleOptimizer`, multiplies by its current dynamic scale;
        otherwise returns `loss` unchanged.

        Args:
            loss: Scalar tensor, the micro-batch loss from `compute_loss`.

        Returns:
            The loss to differentiate.
        """
        return self._loss_scaling.scale_loss(loss)

    def get_unscaled_gradients(self, gradients):
        """Undoes `get_scaled_loss` on a micro-batch's gradients.

        Args:
            gradients: List of gradient tensors (or None), one per trainable
                variable, of the scaled loss.

        Returns:
            The gradients of the unscaled loss, in the same order.
        """
        return self._loss_scaling.unscale_gradients(gradients)

    def micro_batch_weight(self, x, y, y_pred, sample_weight):
        """Returns what Keras divides this micro-batch's loss by.

        The window gradient is the mean of the micro-batch gradients weighted
        by this number, which makes it the large batch's gradient. The
        default is the number of loss elements: samples, or time steps times
        samples for sequence outputs, or the valid elements when the output
        carries a Keras mask. Override it for a custom loss that divides by
        something else.

        Args:
            x: Micro-batch inputs.
            y: Micro-batch targets.
            y_pred: Predictions for `x`.
            sample_weight: Micro-batch sample weights, or None.

        Returns:
            A float32 scalar tensor.
        """
        del y, sample_weight
        return _loss_divisor.loss_divisor(x, y_pred)

    # Training --------------------------------------------------------------

    def fit(self, *args, **kwargs):
        if self.n_gradients == 1:
            return super().fit(*args, **kwargs)
        self._check_ready_to_accumulate()
        bound = inspect.signature(keras.Model.fit).bind(self, *args, **kwargs)
        arguments = bound.arguments
        arguments["callbacks"] = self._with_window_callback(
            arguments.get("callbacks")
        )
        del arguments["self"]
        return super().fit(**arguments)

    def _check_ready_to_accumulate(self):
        """Raises before training if the compiled set-up cannot accumulate."""
        _checks.check_optimizer_does_not_accumulate(self.optimizer)
        _checks.check_strategy(self.distribute_strategy)
        _checks.check_loss_reductions(tree.flatten(self.loss))

    def _with_window_callback(self, callbacks):
        window_callback = WindowCallback(self)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            window_callback.set_model(self)
            callbacks.callbacks.insert(0, window_callback)
            return callbacks
        return [window_callback] + list(callbacks or [])

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Overrides a private Keras hook; see `_keras_private`.
        distributed = getattr(self, "_distribute_strategy", None) is not None
        if self.n_gradients == 1 or not distributed or iterator is None:
            return super()._maybe_symbolic_build(iterator, data_batch)
        _keras_private.symbolic_build_from_local_batch(self, iterator)

    def make_train_function(self, force=False):
        if self.n_gradients == 1:
            return super().make_train_function(force)
        if self.train_function is not None and not force:
            return self.train_function
        self._check_ready_to_accumulate()
        self._check_no_window_left_open()
        self._settle_configuration()
        if self.built:
            self._build_training_state()
        super().make_train_function(force)
        self.train_function = self._applying_open_window_at_end_of_data(
            self.train_function
        )
        return self.train_function

    def _check_no_window_left_open(self):
        """Refuses to forget gradients when the trainable weights changed."""
        window = self._gradient_window
        if window is None or window.matches(self.trainable_variables):
            return
        open_steps = int(window.micro_steps.numpy())
        if open_steps:
            raise ValueError(
                "The model's trainable weights changed while a window was "
                f"open ({open_steps} micro-batches accumulated and not yet "
                "applied). Call `model.apply_open_window()` before changing "
                "which weights are trainable. Received: "
                f"{len(self.trainable_variables)} trainable variables, "
                f"window built for {len(window.trainable_variables)}"
            )

    def _settle_configuration(self):
        """Decides, once per compiled set-up, how windows are applied."""
        strategy = self.distribute_strategy
        self._loss_scaling = LossScaling(self.optimizer)
        # Keras clips each replica's gradients before summing them over
        # replicas; to clip the window's gradient as one device would, it is
        # summed first (one more reduction per window, only in this case).
        update_optimizer = self._loss_scaling.update_optimizer
        self._reduce_before_clipping = strategy.num_replicas_in_sync > 1 and any(
            getattr(update_optimizer, name, None) is not None
            for name in ("clipnorm", "clipvalue", "global_clipnorm")
        )
        self._compute_loss_takes_training = (
            "training" in inspect.signature(self.compute_loss).parameters
        )
        self._apply_open_window_function = self._make_apply_open_window()

    def _build_training_state(self):
        """Creates optimizer and window variables for the model's weights.

        Needs the model's weights, which a subclassed model only has after
        its first call: then it runs while the training step is traced.
        """
        strategy = self.distribute_strategy
        if not self.optimizer.built:
            with strategy.scope():
                self.optimizer.build(self.trainable_variables)
        window = self._gradient_window
        if window is None or not window.matches(self.trainable_variables):
            self._gradient_window = GradientWindow(
                self.trainable_variables, strategy, self._epoch_steps
            )
            # The apply function reads the window when first traced.
            self._apply_open_window_function = self._make_apply_open_window()

    def _start_epoch(self, steps):
        """Called as an epoch begins, with its micro steps if known."""
        known = self.flush_each_epoch and steps
        self._epoch_steps = int(steps) if known else -1
        if self._gradient_window is not None:
            self._gradient_window.steps_left_in_epoch.assign(self._epoch_steps)

    def _applying_open_window_at_end_of_data(self, train_function):
        def train_function_applying_open_window(iterator):
            try:
                return train_function(iterator)
            except StopIteration:
                if self.flush_each_epoch:
                    self.apply_open_window()
                raise

        return train_function_applying_open_window

    def _make_apply_open_window(self):
        def replica_step():
            window = self._gradient_window
            self._end_window_if(window.micro_steps > 0)

        def apply_open_window():
            self.distribute_strategy.run(replica_step)

        if self.run_eagerly:
            return apply_open_window
        return tf.function(apply_open_window)

    def apply_open_window(self):
        """Applies the gradients of the window still open, if any.

        `fit()` calls this itself at the end of each epoch (or of training,
        with `flush_each_epoch=False`); call it only when driving
        `train_on_batch` or a custom loop by hand.
        """
        if self.n_gradients == 1 or self._apply_open_window_function is None:
            return
        self._apply_open_window_function()

    def train_step(self, data):
        if self.n_gradients == 1:
            return super().train_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        num_replicas = self.distribute_strategy.num_replicas_in_sync
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            if self._gradient_window is None:
                with tf.init_scope():
                    self._build_training_state()
            loss = self._micro_batch_loss(x, y, y_pred, sample_weight)
            scaled_loss = self.get_scaled_loss(loss)
        trainable_variables = self._gradient_window.trainable_variables
        gradients = tape.gradient(scaled_loss, trainable_variables)
        gradients = self.get_unscaled_gradients(gradients)

        # Keras divided this replica's loss by its own divisor and by the
        # number of replicas; multiplying both back gives the gradient of the
        # summed loss, which the window end divides by the window's total.
        weight = tf.cast(
            self.micro_batch_weight(x, y, y_pred, sample_weight), tf.float32
        )
        window = self._gradient_window
        window.add(gradients, weight, gradient_scale=weight * num_replicas)
        self._track_loss(x, loss, num_replicas)

        window_full = window.micro_steps >= self.n_gradients
        epoch_ends = tf.equal(window.steps_left_in_epoch, 0)
        self._end_window_if(tf.logical_or(window_full, epoch_ends))
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if self._loss_scaling.active:
            # An overflow must never pass silently: show the count.
            logs = {**logs, "skipped_windows": window.skipped_windows.value()}
        return _keras_private.logs_for_reduction(
            logs, self.distribute_strategy
        )

    def _micro_batch_loss(self, x, y, y_pred, sample_weight):
        if self._compute_loss_takes_training:
            return self.compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                training=True,
            )
        return self.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight
        )

    def _track_loss(self, x, loss, num_replicas):
        tracker = _keras_private.loss_tracker(self)
        if tracker is None:
            return
        tracker.update_state(
            loss * tf.cast(num_replicas, loss.dtype),
            sample_weight=_loss_divisor.batch_size(x),
        )

    # Window end ------------------------------------------------------------

    def _end_window_if(self, should_end):
        """From replica context: ends the window when `should_end` holds."""
        _replicas.run_if(should_end, self._end_window)

    def _end_window(self):
        """Applies (or skips, on overflow) the window, then empties it.

        Runs in replica or cross-replica context (see `_replicas`). The only
        communication: one small reduction of the window's weight and
        finiteness, and the optimizer's reduction of the gradients.
        """
        window = self._gradient_window
        scaling = self._loss_scaling

        if scaling.active:
            totals = _replicas.sum_over_replicas(
                lambda: tf.stack([window.weight_sum, window.local_is_finite()])
            )
            total_weight = totals[0]
            num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
            finite = tf.equal(totals[1], float(num_replicas))
        else:
            total_weight = _replicas.sum_over_replicas(
                lambda: tf.identity(window.weight_sum)
            )
            finite = None

        def update():
            _replicas.for_each_replica(self._apply_mean_gradients, total_weight)
            scaling.after_update()

        def skip():
            scaling.after_overflow()
            _replicas.for_each_replica(
                lambda: window.skipped_windows.assign_add(1)
            )

        if finite is None:
            update()
        else:
            tf.cond(finite, update, skip)
        _replicas.for_each_replica(window.reset)

    def _apply_mean_gradients(self, total_weight):
        """Replica context: hands the window gradient to the optimizer."""
        window = self._gradient_window
        gradients = window.mean_gradients(total_weight)
        if self._reduce_before_clipping:
            gradients = _replicas.summed_into_first_replica(gradients)
        pairs = [
            (g, v)
            for g, v in zip(gradients, window.trainable_variables)
            if g is not None
        ]
        self._loss_scaling.update_optimizer.apply(
            [g for g, _ in pairs], [v for _, v in pairs]
        )
