"""The public `AccumulatingModel` class."""

import warnings

import tensorflow as tf

from accum_model import _checks
from accum_model import _loss_divisor
from accum_model import _model_classes
from accum_model import _replicas
from accum_model._accumulator import GradientWindow
from accum_model._adapter import keras
from accum_model._adapter import private
from accum_model._window_callback import WindowCallback
from accum_model._window_checkpoint import WindowCheckpoint
from accum_model._window_end import WindowEnd
from accum_model._window_policy import UpdateSignal
from accum_model._window_policy import WindowPolicy
from accum_model._window_policy import check_n_gradients
from accum_model._window_policy import n_gradients_from_config

# Constructor arguments of AccumulatingModel itself, with their defaults.
SETTINGS = {"n_gradients": 1, "flush_each_epoch": True,
            "accumulator_dtype": "float32"}


@keras.saving.register_keras_serializable(package="accum_model")
class AccumulatingModel(private.ModelDifferences, keras.Model):
    """A `keras.Model` that applies one update per `n_gradients` micro-batches.

    The base class is `tf.keras.Model` of the running process: Keras 3, or
    Keras 2 (TensorFlow 2.13-2.15's own, or `tf_keras` with
    `TF_USE_LEGACY_KERAS=1`), with the same behaviour.

    Each call of `train_step` (one micro-batch, one *micro step*) adds the
    micro-batch's gradient to float32 accumulators, weighted by what Keras
    divides that micro-batch's loss by. After `n_gradients` micro steps the
    model applies one optimizer update (one *gradient step*) with the
    weighted mean gradient, which is the gradient of the loss of the
    concatenated micro-batches: n micro-batches of size b train like one
    batch of n*b. Optimizer state, `optimizer.iterations`, learning-rate
    schedules, clipping and weight decay only move on gradient steps.

    The window still open when an epoch ends is applied with the weight of
    what it holds (`flush_each_epoch=True`), before validation, or carried
    on into the next epoch and applied at the end of the last one
    (`flush_each_epoch=False`). Either way no gradient is left unapplied
    when `fit()` returns.

    Use it like `keras.Model`: functionally,
    `AccumulatingModel(inputs=..., outputs=..., n_gradients=4)`, or as a base
    class whose `__init__` calls `super().__init__(n_gradients=4, **kwargs)`,
    alone or next to another model class
    (`class Net(AccumulatingModel, SomeKerasModel)`). Metrics, the loss in the
    progress bar and callbacks see every micro step. `evaluate()` and
    `predict()` are those of `keras.Model`. A subclass that writes its own
    `train_step` hands each micro-batch's gradients to
    `accumulate_gradients`.

    Under mixed precision (`LossScaleOptimizer`), each micro step scales its
    loss with `get_scaled_loss` and unscales its gradients with
    `get_unscaled_gradients` before accumulating them. A window in which any
    gradient overflowed, on any replica, is skipped as a whole and lowers
    the loss scale once; `skipped_windows` counts such windows.

    Args:
        n_gradients: Int >= 1. Number of micro-batches whose gradients make
            one update. 1 trains exactly like `keras.Model`. Or a schedule,
            a dict `{epoch: n}`: each n holds from its 0-based epoch on,
            windows of 1 before the smallest key; a change takes effect at
            the next window boundary. May be changed between `fit()` calls
            while no window is open.
        flush_each_epoch: Bool. Whether the window open at the end of an
            epoch is applied then (True, the default) or continued in the
            next epoch (False).
        accumulator_dtype: The dtype gradients are summed in: "float32"
            (default), "float64", or "bfloat16" / "float16" to halve the
            accumulators' memory at a cost in exactness. A window whose
            narrow sum overflowed is skipped and counted in
            `skipped_windows`.
        **kwargs: Passed to `keras.Model`.
    """

    def __new__(cls, *args, **kwargs):
        return super().__new__(_model_classes.instance_class(cls), *args,
                               **kwargs)

    def __init__(self, *args, n_gradients=1, flush_each_epoch=True,
                 accumulator_dtype="float32", **kwargs):
        policy = WindowPolicy(n_gradients, accumulator_dtype)
        flush_each_epoch = _checks.check_flush_each_epoch(flush_each_epoch)
        _checks.check_keyword_arguments(
            type(self), kwargs, _model_classes.is_functional_call(args, kwargs),
            own_arguments=SETTINGS,
        )
        super().__init__(*args, **kwargs)
        self._init_accumulation(policy, flush_each_epoch)
        self._keep_settings_in_clones()

    def _init_accumulation(self, policy, flush_each_epoch):
        """Sets the state of accumulation; also used by `accumulating`."""
        self._window_policy = policy
        self._update_signal = UpdateSignal()
        self._epoch = 0
        self.flush_each_epoch = flush_each_epoch
        self._gradient_window = None
        self._window_end = None
        self._loss_scaling = None
        self._epoch_steps = -1
        self._weight_from_batch_size = False
        # Saved and restored with the model by every kind of checkpoint.
        self._window_checkpoint = WindowCheckpoint(self)

    # Configuration ---------------------------------------------------------

    def _settings(self):
        return {name: getattr(self, name) for name in SETTINGS}

    def get_config(self):
        config = super().get_config()
        config.update(self._settings())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if "n_gradients" in config:
            config["n_gradients"] = n_gradients_from_config(
                config["n_gradients"]
            )
        model = super().from_config(config, custom_objects=custom_objects)
        # keras 3.6 rebuilds a functional model from its layers alone and
        # drops the other constructor arguments: restore them.
        settings = {k: config[k] for k in SETTINGS if k in config}
        if isinstance(model, AccumulatingModel) and any(
            getattr(model, k) != v for k, v in settings.items()
        ):
            model._init_accumulation(
                WindowPolicy(
                    settings.get("n_gradients", model.n_gradients),
                    settings.get("accumulator_dtype",
                                 model.accumulator_dtype),
                ),
                settings.get("flush_each_epoch", model.flush_each_epoch),
            )
            model._keep_settings_in_clones()
        return model

    def _keep_settings_in_clones(self):
        """Gives a functional instance the class `clone_model` needs."""
        if not isinstance(self, private.Functional):
            return
        self.__class__ = _model_classes.with_settings_for_clones(
            type(self),
            {k: v for k, v in self._settings().items() if v != SETTINGS[k]},
        )

    @property
    def n_gradients(self):
        """Int, or dict `{epoch: n}`: micro-batches per update, as given."""
        return self._window_policy.n_gradients

    @property
    def accumulator_dtype(self):
        """Str. The dtype the gradients are summed in."""
        return self._window_policy.accumulator_dtype

    @n_gradients.setter
    def n_gradients(self, value):
        value = check_n_gradients(value)
        open_steps = self._open_micro_steps()
        if open_steps and value != self.n_gradients:
            raise ValueError(
                "`n_gradients` can only change at a window boundary: "
                f"{open_steps} micro-batches are accumulated and not yet "
                "applied. Call `model.apply_open_window()` first. Received: "
                f"n_gradients={value!r}"
            )
        self._window_policy.n_gradients = value
        if self._gradient_window is not None:
            self._gradient_window.set_length(
                self._window_policy.length_for_epoch(self._epoch)
            )
        # Switching between Keras's own step and accumulation: trace anew.
        self.train_function = None

    # Public state ----------------------------------------------------------

    @property
    def skipped_windows(self):
        """Int. Windows skipped because a gradient overflowed (mixed precision)."""
        if self._gradient_window is None:
            return self._window_checkpoint.pending_count("skipped_windows")
        return int(self._gradient_window.skipped_windows.numpy())

    @property
    def update_applied(self):
        """Bool. Whether the micro-batch just trained applied an update.

        Read it in a callback's `on_train_batch_end`: true exactly on the
        micro-batches that closed a window and applied the optimizer (a
        window skipped for overflow is no update). With
        `steps_per_execution` > 1 callbacks see executions, and it is true
        when any micro-batch of the execution applied one. Reading it waits
        for the step to finish.
        """
        return self._update_signal.applied()

    @property
    def accumulator_bytes(self):
        """Int. Bytes held by the gradient accumulators of one replica."""
        if self._gradient_window is None:
            return 0
        return self._gradient_window.accumulator_bytes

    def _open_micro_steps(self):
        window = getattr(self, "_gradient_window", None)
        if window is None:
            return self._window_checkpoint.pending_count("micro_steps")
        return int(window.micro_steps.numpy())

    # Hooks a subclass may override -----------------------------------------

    def get_scaled_loss(self, loss):
        """Scales a micro-batch loss before its gradients are taken.

        Multiplies by the optimizer's `loss_scale_factor`, if set, and with a
        `LossScaleOptimizer` by its current dynamic scale; otherwise returns
        `loss` unchanged.

        Args:
            loss: Scalar tensor, the micro-batch loss from `compute_loss`.

        Returns:
            The loss to differentiate.
        """
        return self._loss_scaling.scale_loss(loss)

    def get_unscaled_gradients(self, gradients):
        """Undoes the dynamic part of `get_scaled_loss` on gradients.

        A `loss_scale_factor` is left in: the optimizer divides it out when
        it applies the window.

        Args:
            gradients: List of gradient tensors (or None), one per trainable
                variable, of the scaled loss.

        Returns:
            The gradients, in the same order.
        """
        window = self._gradient_window
        return self._loss_scaling.unscale_gradients(
            gradients, window.trainable_variables if window else None
        )

    def micro_batch_weight(self, x, y, y_pred, sample_weight):
        """Returns what Keras divides this micro-batch's loss by.

        The window gradient is the mean of the micro-batch gradients weighted
        by this number, which makes it the large batch's gradient. The
        default is what Keras divided the compiled loss by in this micro
        step: the number of loss elements, or of valid elements under a
        Keras mask or a mask the loss makes itself (`ignore_class`), or the
        sum of the sample weights with "mean_with_sample_weight"; a loss
        reduced with "sum" is summed over the window. With several outputs
        the first output's divisor serves, and a warning says so once when
        the outputs' divisors may not keep one ratio. When `compute_loss` is
        overridden, the default is the number of samples (exact for a loss
        that is a mean of per-sample losses), with a one-time warning.
        Override this method for a loss that divides by something else.

        Args:
            x: Micro-batch inputs.
            y: Micro-batch targets.
            y_pred: Predictions for `x`.
            sample_weight: Micro-batch sample weights, or None.

        Returns:
            A float32 scalar tensor.
        """
        del y, sample_weight
        if self._weight_from_batch_size:
            return tf.cast(_loss_divisor.batch_size(x), tf.float32)
        weight = _loss_divisor.micro_batch_weight(
            getattr(self, "_traced_loss_reductions", []), x, y_pred,
            type(self).__name__, has_other_losses=bool(self.losses),
        )
        # A loss reduced with "sum" is not divided: neither is its window.
        self._window_end.divide_by_weight = weight is not _loss_divisor.SUM
        if weight is _loss_divisor.SUM:
            return tf.constant(1.0)
        return weight

    # Training --------------------------------------------------------------

    def fit(self, *args, **kwargs):
        if not self._window_policy.accumulates:
            return super().fit(*args, **kwargs)
        self._check_ready_to_accumulate()
        args, kwargs = WindowCallback.added_to_fit_arguments(self, args, kwargs)
        return super().fit(*args, **kwargs)

    def _check_ready_to_accumulate(self):
        """Raises (or warns) before training if the set-up cannot accumulate."""
        self._weight_from_batch_size = _checks.check_ready_to_accumulate(
            self, _model_classes.requested_class(type(self))
        )

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        accumulates = self._window_policy.accumulates
        if accumulates:
            self._check_ready_to_accumulate()
            _checks.check_no_window_left_open(self, self.trainable_variables)
            self._settle_configuration()
        super().make_train_function(force)
        if accumulates:
            self.train_function = WindowCallback.applying_open_window_at_end(
                self.train_function, self
            )
        self.train_function = self._update_signal.watching(
            self.train_function, self.optimizer
        )
        return self.train_function

    def _settle_configuration(self):
        """Decides, once per compiled set-up, how windows are applied."""
        self._loss_scaling = private.LossScaling(self.optimizer)
        if self._gradient_window is not None:
            self._window_end = self._make_window_end(self._gradient_window)

    def _make_window_end(self, window):
        return WindowEnd.for_model(window, self._loss_scaling, self)

    def _ensure_training_state(self):
        """Creates optimizer and window variables for the trainable weights.

        Runs in the training step, after the forward pass, because only then
        does every weight exist: a subclassed model creates its weights in
        its first call, and a layer used only in training in its first
        training call.
        """
        variables = self.trainable_variables
        if not variables:
            # What Keras's own step says; the window then updates nothing.
            warnings.warn("The model does not have any trainable weights.")
        window = self._gradient_window
        if (window is not None and window.matches(variables)
                and self._loss_scaling.is_built()):
            return
        _replicas.in_cross_replica_context(
            lambda: self._build_training_state(variables)
        )

    def _build_training_state(self, variables):
        with tf.init_scope():
            _checks.check_no_window_left_open(self, variables)
            strategy = self.distribute_strategy
            if not self._loss_scaling.is_built():
                with strategy.scope():
                    self._loss_scaling.build(variables)
            window = self._gradient_window
            if window is None or not window.matches(variables):
                policy = self._window_policy
                self._gradient_window = GradientWindow(
                    variables, strategy, self._epoch_steps,
                    length=policy.length_for_epoch(self._epoch),
                    accumulator_dtype=policy.dtype,
                )
                self._window_checkpoint.window_built(self._gradient_window)
                self._window_end = self._make_window_end(self._gradient_window)

    def _start_epoch(self, steps, epoch=None):
        """Called as an epoch begins, with its micro steps if known."""
        known = self.flush_each_epoch and steps
        self._epoch_steps = int(steps) if known else -1
        if epoch is not None:
            self._epoch = epoch
        window = self._gradient_window
        if window is not None:
            window.steps_left_in_epoch.assign(self._epoch_steps)
            window.set_length(self._window_policy.length_for_epoch(self._epoch))

    def apply_open_window(self):
        """Applies the gradients of the window still open, if any.

        `fit()` calls this itself at the end of each epoch (or of training,
        with `flush_each_epoch=False`); call it only when driving
        `train_on_batch` or a custom loop by hand.
        """
        if self._window_end is None:
            return
        self._window_end.apply_open()

    def train_step(self, data):
        if not self._window_policy.accumulates:
            return super().train_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            # This replica's own mean loss, never divided by the replicas:
            # the window end divides by the whole window's weight instead.
            with private.losses_not_divided_by_replicas(), \
                    private.recording_loss_reductions() as reductions:
                loss = private.compute_loss(
                    self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight
                )
            self._traced_loss_reductions = reductions
            scaled_loss = self.get_scaled_loss(loss)
        self._ensure_training_state()
        window = self._gradient_window
        gradients = tape.gradient(scaled_loss, window.trainable_variables)
        gradients = self.get_unscaled_gradients(gradients)
        batch_size = _loss_divisor.batch_size(x)
        private.track_loss(self, loss, batch_size)

        # The loss is a mean over `weight` elements; multiplying it back
        # gives the gradient of the summed loss, which the window end
        # divides by the window's total weight.
        weight = tf.cast(
            self.micro_batch_weight(x, y, y_pred, sample_weight), tf.float32
        )
        _checks.warn_if_activity_penalty_is_masked(type(self), self, y_pred)
        self._add_micro_step(gradients, weight, batch_size)
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if self._window_end.checks_finite:
            # An overflow must never pass silently: show the count.
            logs = {**logs, "skipped_windows": window.skipped_windows.value()}
        return private.logs_for_reduction(
            logs, self.distribute_strategy
        )

    def accumulate_gradients(self, gradients, weight, batch_size=None):
        """Adds one micro-batch's gradients to the window; applies it when due.

        For a subclass that writes its own `train_step`: call this once per
        step instead of `optimizer.apply_gradients`, and the step accumulates
        exactly like the built-in one, under every strategy the model
        supports (call it from `train_step`, in replica context).

        Args:
            gradients: List of gradients, one per `self.trainable_variables`
                (None where a variable has none), of this replica's
                micro-batch loss, unscaled (see `get_unscaled_gradients`).
                The loss is taken to be a mean over `weight` elements, not
                divided by the number of replicas.
            weight: Scalar. What the micro-batch loss was divided by (for a
                mean over samples, the number of samples). Windows average
                micro-batch gradients weighted by it.
            batch_size: Optional scalar, the micro-batch's number of samples.
                A step whose batch is empty on every replica (as at the end
                of data of unknown length) then counts as no micro step.
        """
        self._ensure_training_state()
        weight = tf.cast(weight, tf.float32)
        if batch_size is None:
            batch_size = tf.constant(1)
        self._add_micro_step(list(gradients), weight, batch_size)

    def _add_micro_step(self, gradients, weight, batch_size):
        window = self._gradient_window
        if len(gradients) != len(window.trainable_variables):
            raise ValueError(
                "Expected one gradient per trainable variable "
                f"({len(window.trainable_variables)}). Received: "
                f"{len(gradients)} gradients"
            )
        samples = tf.cast(batch_size, tf.float32)
        has_data = _replicas.has_data_on_some_replica(
            samples, self.distribute_strategy, exact=not self.flush_each_epoch
        )
        window.add(gradients, weight, samples, has_data)
        window_full = window.is_full()
        epoch_ends = tf.equal(window.steps_left_in_epoch, 0)
        self._window_end.end_if(
            tf.logical_and(has_data, tf.logical_or(window_full, epoch_ends))
        )
