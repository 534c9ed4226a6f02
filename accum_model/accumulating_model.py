"""The public `AccumulatingModel` class: the Keras hooks of accumulation.

The promise, the window's state and its transitions, lives in
`accum_model.core.window`, run by the backend's store; this class connects
it to Keras's `fit()`, `train_step`, configuration and saving, through the
adapter of the Keras in use.
"""

import functools
import inspect
import warnings

from accum_model import _checks
from accum_model import _model_classes
from accum_model._chooser import adapter
from accum_model._chooser import keras
from accum_model._window_callback import WindowCallback
from accum_model.core import class_tree
from accum_model.core import messages
from accum_model.core.settings import Settings
from accum_model.core.settings import n_gradients_from_config


def _computing_losses_per_replica(train_step):
    """A `train_step` of the user's own that feeds the window, run with
    Keras's losses left undivided by the replicas.

    Under a strategy Keras's losses (a `keras.losses` object,
    `compute_loss`) divide by the number of replicas, where a loss written
    with the backend's ops (`tf.reduce_mean`) does not; the window takes
    every micro-batch loss as the replica's own mean, as the built-in step
    computes it.
    """

    @functools.wraps(train_step)
    def train_step_of_the_window(self, *args, **kwargs):
        with adapter.losses.losses_not_divided_by_replicas():
            return train_step(self, *args, **kwargs)

    return train_step_of_the_window


def _setting(name, summary):
    """A property of the model for the accumulation setting `name`."""

    def get(model):
        return getattr(model._accumulation.settings, name)

    def set_(model, value):
        model._accumulate_with(model._settings_with(**{name: value}))

    doc = summary + ("\n\nMay be set between `fit()` calls while no window "
                     "is open (`ValueError` otherwise).")
    return property(get, set_, doc=doc)


@keras.saving.register_keras_serializable(package="accum_model")
class AccumulatingModel(adapter.ModelDifferences, keras.Model):
    """A `keras.Model` that applies one update per `n_gradients` micro-batches.

    A *window* is the `n_gradients` micro-batches whose gradients make one
    optimizer update: n micro-batches of size b train like one batch of n*b.
    The base class is `tf.keras.Model` of the running process: Keras 3, or
    Keras 2 (TensorFlow 2.13-2.15's own, or `tf_keras` with
    `TF_USE_LEGACY_KERAS=1`), with the same behaviour.

    Each call of `train_step` (one micro-batch, one *micro step*) adds the
    micro-batch's gradient to float32 accumulators, weighted by what Keras
    divides that micro-batch's loss by. After `n_gradients` micro steps the
    model applies one optimizer update (one *gradient step*) with the
    weighted mean gradient, which is the gradient of the loss of the
    concatenated micro-batches. Optimizer state, `optimizer.iterations`, learning-rate
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
    (`class Net(AccumulatingModel, SomeKerasModel)`). Compiled metrics and
    callbacks see every micro step; the loss in the logs is each window's,
    logged when it ends, as the large batch's would be. `evaluate()` and
    `predict()` are those of `keras.Model`. A subclass that writes its own
    `train_step` hands each micro-batch's gradients to
    `accumulate_gradients`.

    On Keras 3, a training `BatchNormalization` layer's moving mean and
    variance move once per window, from the window's pooled statistics, as
    the large batch's would; its forward pass still normalises each
    micro-batch with that micro-batch's own statistics (`fit()` warns).

    Under mixed precision (`LossScaleOptimizer`), each micro step scales its
    loss with `get_scaled_loss` (by the dynamic scale over the window's
    length and the replicas, so that it overflows where the large batch
    would) and unscales its gradients with `get_unscaled_gradients` before
    accumulating them. A window in which any gradient overflowed, on any
    replica, or whose float16 gradient sum would overflow in the large
    batch, is skipped as a whole and lowers the loss scale once;
    `skipped_windows` counts such windows.

    Args:
        n_gradients: Int >= 1. Number of micro-batches whose gradients make
            one update. 1 trains exactly like `keras.Model` (under several
            replicas of a `tf.distribute` strategy, in windows of one,
            which keep to the one-device large batch where Keras's own
            step strays from it). Or a schedule,
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
        measure_noise_scale: Bool, default False. Whether each epoch's logs
            (the progress bar, `History`, `CSVLogger`, `TensorBoard`) carry
            `noise_scale`: the gradient noise scale B_noise, in samples (in
            the unit of the micro-batch weight: valid tokens for a masked
            loss), measured from the windows' micro-batch gradients at the
            cost of one squared norm per micro-batch. Training batches far
            above it mostly waste compute. Needs windows of 2 or more
            micro-batches; an epoch with none carries no `noise_scale`.
        micro_batch_size: None (default), or an int >= 1: each batch
            `fit()` hands the training step (per replica, under a
            distribution) is split inside that step into micro-batches of
            at most this many samples, whose gradients go into the window
            together. `fit(batch_size=256)` with `micro_batch_size=32`
            applies one update per batch of 256 while holding the
            activations of 32: steps, callbacks, schedules and progress
            bars count the batches of `fit()`. With `n_gradients=n` too, a
            window is n such batches. Or "auto": the largest micro-batch
            that fits, chosen before the first update and said in one
            line (on JAX from the compiled step's memory, per batch shape;
            on PyTorch and TensorFlow by trying micro-batches and backing
            off on the device's out-of-memory error).
        memory_limit: None (default), or the bytes a training step may hold
            on one device, read by `micro_batch_size="auto"` on JAX in
            place of the device's memory (which a CPU does not report).
        **kwargs: Passed to `keras.Model`.
    """

    # Lets code below the model layer find this class in an MRO
    # (`core.class_tree.accumulating_base`) without importing it.
    _accum_model_base = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own_step = cls.__dict__.get("train_step")
        if own_step is not None and (
                class_tree.WINDOW_HOOKS & class_tree.names_used_by(own_step)):
            cls.train_step = _computing_losses_per_replica(own_step)

    def __new__(cls, *args, **kwargs):
        return super().__new__(_model_classes.instance_class(cls), *args,
                               **kwargs)

    def __init__(self, *args, n_gradients=1, flush_each_epoch=True,
                 accumulator_dtype="float32", measure_noise_scale=False,
                 micro_batch_size=None, memory_limit=None, **kwargs):
        settings = Settings(n_gradients, flush_each_epoch, accumulator_dtype,
                            measure_noise_scale, micro_batch_size,
                            memory_limit)
        _checks.check_keyword_arguments(
            type(self), kwargs,
            _model_classes.is_functional_call(args, kwargs),
            own_arguments=Settings.DEFAULTS,
        )
        with _model_classes.ancestors_kept(type(self)):
            super().__init__(*args, **kwargs)
        self._accumulate_with(settings)

    # `inspect.signature` (help(), editors) reads a class's `__new__` before
    # its `__init__`: show the constructor's arguments, not `*args, **kwargs`.
    __new__.__signature__ = inspect.signature(__init__)

    def _accumulate_with(self, settings):
        """Takes `settings`: the one path of the constructor, `from_config`,
        `accumulating()` and the setters.

        Raises:
            ValueError: A window is open and the settings differ.
        """
        accumulation = getattr(self, "_accumulation", None)
        if accumulation is None:
            accumulation = adapter.Accumulation(settings)
            accumulation.own_step_feeds_window = (
                class_tree.own_step_feeds_window(type(self)))
            accumulation.several_replicas = (
                adapter.replicas_in_sync(self) > 1)
            accumulation.checkpoint = adapter.WindowCheckpoint(accumulation)
            self._accumulation = accumulation
            # Every checkpoint finds the window under this attribute name.
            self._window_checkpoint = accumulation.checkpoint
            # A compiled model has traced (or may trace) Keras's own step.
            self.train_function = None
        elif accumulation.reconfigure(settings):
            self.train_function = None
        self._keep_settings_in_clones()

    def _settings_with(self, **changes):
        return Settings(**{**self._accumulation.settings.as_dict(), **changes})

    # Configuration ---------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config.update(self._accumulation.settings.as_dict())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if "n_gradients" in config:
            config["n_gradients"] = n_gradients_from_config(
                config["n_gradients"]
            )
        next_from_config = super().from_config
        # Keras's own takes `custom_objects`; many classes' (keras-hub's
        # `Task`, say) take the config alone.
        if _model_classes.takes_keyword(next_from_config, "custom_objects"):
            model = next_from_config(config, custom_objects=custom_objects)
        else:
            model = next_from_config(config)
        if isinstance(model, AccumulatingModel):
            # keras 3.6 rebuilds a functional model from its layers alone and
            # drops the other constructor arguments: restore them.
            model._accumulate_with(Settings.from_config(
                config, defaults=model._accumulation.settings.as_dict()
            ))
        return model

    def _keep_settings_in_clones(self):
        """Gives a functional instance the class `clone_model` needs."""
        if not isinstance(self, adapter.Functional):
            return
        self.__class__ = _model_classes.with_settings_for_clones(
            type(self), self._accumulation.settings.non_defaults()
        )

    n_gradients = _setting(
        "n_gradients",
        "Int, or dict `{epoch: n}`: micro-batches per update, as given.",
    )
    flush_each_epoch = _setting(
        "flush_each_epoch",
        "Bool. Whether the window open at an epoch's end is applied then.",
    )
    accumulator_dtype = _setting(
        "accumulator_dtype",
        "Str. The dtype the gradients are summed in (a new dtype builds the "
        "accumulators anew at the next step).",
    )
    measure_noise_scale = _setting(
        "measure_noise_scale",
        "Bool. Whether epochs log the gradient noise scale, `noise_scale`.",
    )
    micro_batch_size = _setting(
        "micro_batch_size",
        "None, int or \"auto\": the most samples of a micro-batch that "
        "each step splits its batch into.",
    )
    memory_limit = _setting(
        "memory_limit",
        "None, or int: the bytes `micro_batch_size=\"auto\"` fits a step "
        "to.",
    )

    # Public state ----------------------------------------------------------

    @property
    def skipped_windows(self):
        """Int. Windows skipped because a gradient overflowed (mixed precision)."""
        return self._accumulation.skipped_windows()

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
        return self._accumulation.update_signal.applied()

    @property
    def accumulator_bytes(self):
        """Int. Bytes held by the gradient accumulators of one replica."""
        return self._accumulation.accumulator_bytes()

    def has_task_weights(self):
        """Whether a keras-hub preset saves weights of this task beyond its
        backbone's: also where a window is open, so that `save_to_preset`
        carries the window and `from_preset` restores it (keras-hub 0.32.0
        saves and loads a task's own weights only where this is true)."""
        own = getattr(super(), "has_task_weights", None)
        return bool(own is not None and own()) or (
            self._accumulation.open_micro_steps() > 0)

    # Hooks a subclass may override -----------------------------------------

    def get_scaled_loss(self, loss):
        """Scales a micro-batch loss before its gradients are taken.

        Multiplies by the optimizer's `loss_scale_factor`, if set, and with a
        `LossScaleOptimizer` by its current dynamic scale divided by the
        window's length and the number of replicas: a micro-batch's
        per-sample terms in the backward pass are then the large batch's,
        so it overflows where the large batch would. Otherwise returns
        `loss` unchanged.

        Args:
            loss: Scalar tensor, the micro-batch loss from `compute_loss`.

        Returns:
            The loss to differentiate.
        """
        accumulation = self._accumulation
        return accumulation.loss_scaling.scale_loss(
            loss, accumulation.micro_batch_share()
        )

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
        accumulation = self._accumulation
        window = accumulation.window
        return accumulation.loss_scaling.unscale_gradients(
            gradients, window.trainable_variables if window else None,
            accumulation.micro_batch_share(),
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
        Override this method for a loss that divides by something else; the
        window is then divided by the sum of the weights it returns.

        Args:
            x: Micro-batch inputs.
            y: Micro-batch targets.
            y_pred: Predictions for `x`.
            sample_weight: Micro-batch sample weights, or None.

        Returns:
            A float32 scalar tensor.
        """
        del y, sample_weight
        return adapter.default_micro_batch_weight(self, x, y_pred)

    # Training --------------------------------------------------------------

    def fit(self, *args, **kwargs):
        if not self._accumulation.accumulates:
            return super().fit(*args, **kwargs)
        left_open = self._accumulation.window_left_open()
        if left_open:
            warnings.warn(
                "fit() starts with a window left open by `train_on_batch` "
                "or a loop driven by hand "
                f"({messages.counted(left_open, 'micro-batch')} "
                "accumulated): the first window of this fit() completes "
                "it. Call `model.apply_open_window()` before fit() to "
                "apply it as an update of its own.",
                stacklevel=2,
            )
        self._check_ready_to_accumulate()
        args, kwargs = WindowCallback.added_to_fit_arguments(self, args, kwargs)
        _checks.warn_if_backups_fall_inside_windows(
            self, kwargs.get("callbacks"), self._accumulation.warn_once)
        _checks.check_micro_batches_split_evenly(kwargs)
        if self._accumulation.settings.micro_batch_size == "auto":
            adapter.choose_micro_batch_size(self, kwargs)
        return super().fit(*args, **kwargs)

    def _check_ready_to_accumulate(self):
        """Raises (or warns) before training if the set-up cannot accumulate.

        An uncompiled model is left to Keras, whose `fit()` then says to
        call `compile()` (Keras 3 has no `optimizer` attribute until then,
        Keras 2 has None).
        """
        if getattr(self, "optimizer", None) is None:
            return
        self._accumulation.weight_from_batch_size = (
            _checks.check_ready_to_accumulate(
                self, _model_classes.requested_class(type(self))
            )
        )

    def save(self, filepath, *args, **kwargs):
        open_steps = self._accumulation.open_micro_steps()
        loads_plain = getattr(type(self), "_accum_model_loads_plain", False)
        if open_steps and loads_plain:
            warnings.warn(
                "The file holds the open window ("
                f"{messages.counted(open_steps, 'micro-batch')} accumulated "
                "and not yet applied), but "
                f"`load_model` gives back a plain {type(self).__name__}, "
                "which does not read the window: after loading, call "
                "`accumulating(model, ...)`, compile, build the optimizer "
                "(`model.optimizer.build(model.trainable_variables)`) and "
                f"`model.load_weights({str(filepath)!r})` to restore it. "
                "Or call `model.apply_open_window()` before saving.",
                stacklevel=2,
            )
        elif loads_plain:
            self._accumulation.warn_once(
                f"`load_model` gives this file back as a plain "
                f"{type(self).__name__}, which does not accumulate: call "
                "`accumulating(model, ...)` on it again after loading (a "
                "functional `keras.Model` or an `AccumulatingModel` subclass "
                "loads accumulating)."
            )
        return super().save(filepath, *args, **kwargs)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        accumulation = self._accumulation
        if accumulation.accumulates:
            self._check_ready_to_accumulate()
            accumulation.check_window_fits(self.trainable_variables)
            accumulation.set_up(
                adapter.LossScaling(self.optimizer), self.run_eagerly,
                report_loss=functools.partial(adapter.losses.track_loss, self),
                float16_gradients=functools.partial(
                    adapter.optimizer.float16_gradient_flags, self),
            )
        super().make_train_function(force)
        if accumulation.accumulates:
            self.train_function = WindowCallback.applying_open_window_at_end(
                self.train_function, self
            )
        self.train_function = accumulation.watch_updates(
            self.train_function, self.optimizer
        )
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        super().make_test_function(force)
        # Under several TensorFlow replicas Keras's evaluation averages the
        # replicas' own losses; this one reduces each as one device does.
        self.test_function = adapter.evaluating_like_one_device(
            self, self.test_function)
        return self.test_function

    def apply_open_window(self):
        """Applies the gradients of the window still open, if any.

        `fit()` calls this itself at the end of each epoch (or of training,
        with `flush_each_epoch=False`); call it only when driving
        `train_on_batch` or a custom loop by hand.
        """
        self._accumulation.apply_open_window()

    def train_step(self, *args):
        # One micro step: `(data)` on TensorFlow, `(state, data)` on JAX.
        if not self._accumulation.accumulates:
            return super().train_step(*args)
        return adapter.accumulating_train_step(self, *args)

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
                divided by the number of replicas (Keras's losses computed
                in such a step are left undivided). A step that calls this
                keeps its window even with `n_gradients=1`.
            weight: Scalar. What the micro-batch loss was divided by (for a
                mean over samples, the number of samples). Windows average
                micro-batch gradients weighted by it.
            batch_size: Optional scalar, the micro-batch's number of samples.
                A step whose batch is empty on every replica (as at the end
                of data of unknown length) then counts as no micro step.
        """
        adapter.accumulate_gradients(self, gradients, weight, batch_size)

    def stateless_accumulate_gradients(self, optimizer_variables, gradients,
                                       trainable_variables, weight):
        """Adds one micro-batch's gradients to the window, statelessly (JAX).

        For a subclass that writes its own stateless
        `train_step(self, state, data)` on Keras 3's JAX backend: call this
        where Keras's step calls `self.optimizer.stateless_apply`. The
        window rides last among the optimizer's values in `state`; pass them
        whole and return what this returns in the new state. On TensorFlow
        the step is stateful: call `accumulate_gradients` there.

        Args:
            optimizer_variables: The optimizer values of the step's `state`,
                as received.
            gradients: List of gradients, one per trainable variable, of the
                micro-batch loss (unscaled), a mean over `weight` elements.
            trainable_variables: The trainable values the gradients were
                taken at.
            weight: Scalar. What the micro-batch loss was divided by.

        Returns:
            `(trainable_variables, optimizer_variables)`: the new values,
            updated where the window ended with this micro-batch.
        """
        return adapter.stateless_accumulate_gradients(
            self, optimizer_variables, gradients, trainable_variables, weight)


# Keras 2 writes the plain class name into `.h5` files and JSON.
adapter.saving.register_plain_name(AccumulatingModel)
