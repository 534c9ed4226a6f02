"""The callbacks that tie windows to `fit()`'s epochs, validation and logs."""

import inspect
import threading

from accum_model._checks import samples_in
from accum_model._chooser import adapter
from accum_model._chooser import keras
from accum_model.core import messages
from accum_model.core.micro_step import SKIPPED_WINDOWS
from accum_model.core.settings import Settings
from accum_model.window_from_noise_scale import WindowFromNoiseScale


class WindowCallback(keras.callbacks.Callback):
    """Keeps windows aligned with `fit()`'s epochs; runs before user callbacks.

    Applies the window still open before anything looks at the epoch's
    weights: before validation (`on_test_begin`) and before the user's
    `on_epoch_end`, when `flush_each_epoch` is set, the epoch is the last,
    or training stops. Writes `skipped_windows` into the epoch's logs after
    such an application, so an overflow skipped there shows in the progress
    bar and the history, and the epoch's `noise_scale` when it is measured
    (NaN in an epoch that measured none, so that every epoch has one).
    An epoch in which no window ended logs as its `loss` the loss of the
    micro-batches it ran, weighted as their window weighs them.

    Args:
        accumulating_model: The `AccumulatingModel` being fitted.
        epochs: Int. The `epochs` argument of `fit()`.
    """

    # Its batch hook only rewrites log entries, and reads the model only
    # on the training thread: Keras 3 may run it off that thread (where no
    # other callback reads a batch's logs), as it runs callbacks of its own.
    async_safe = True

    def __init__(self, accumulating_model, epochs):
        super().__init__()
        self.accumulating_model = accumulating_model
        self.epochs = epochs
        self._epoch = None
        # The open window's loss totals as the epoch began.
        self._loss_start = (0.0, 0.0, 0)
        # The epoch's training loss as Keras's loss tracker holds it, a
        # (total, count) pair, once read: validation resets that tracker
        # and fills it with the validation loss.
        self._training_loss = None
        # Whether the epoch's logged loss is Keras's own (a window ended in
        # it), and the thread that trains.
        self._window_ended_in_epoch = False
        self._training_thread = None

    @classmethod
    def added_to_fit_arguments(cls, model, args, kwargs):
        """Returns `fit()`'s arguments with the window callbacks added."""
        try:
            arguments = inspect.signature(keras.Model.fit).bind(
                model, *args, **kwargs
            ).arguments
        except TypeError as error:
            raise TypeError(_fit_argument_error(error, kwargs)) from None
        del arguments["self"]
        window_callback = cls(model, arguments.get("epochs", 1))
        late_callback = _StoppedWindowCallback(window_callback)
        callbacks = _window_sizers_first(model, arguments.get("callbacks"),
                                         _micro_batch_size(arguments))
        if arguments.get("verbose", "auto") != 0 and _progress_bar_averages():
            progress_bar = _progress_bar_showing_counts(callbacks)
            if progress_bar is not None:
                callbacks = list(callbacks or []) + [progress_bar]
                arguments["callbacks"] = callbacks
        if isinstance(callbacks, keras.callbacks.CallbackList):
            # Keras uses a CallbackList it is given as it is: the callbacks
            # get the model here, and no `params` from Keras.
            window_callback.set_model(model)
            late_callback.set_model(model)
            callbacks.callbacks.insert(0, window_callback)
            callbacks.callbacks.append(late_callback)
        else:
            arguments["callbacks"] = (
                [window_callback] + list(callbacks or []) + [late_callback]
            )
        return (), arguments

    @staticmethod
    def applying_open_window_at_end(train_function, model):
        """Wraps `train_function` to apply the window when data runs out.

        With data of unknown length Keras learns that the epoch ended when
        a run of the train function finds no data (StopIteration, or
        OutOfRangeError in Keras 2): the window open then belongs to the
        epoch that ended.
        """

        def train_function_applying_open_window(*args):
            try:
                return train_function(*args)
            except adapter.END_OF_DATA_ERRORS:
                if model.flush_each_epoch:
                    model.apply_open_window()
                raise

        return train_function_applying_open_window

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._training_loss = None
        self._window_ended_in_epoch = False
        self._training_thread = threading.current_thread()
        model = self.accumulating_model
        # A CallbackList of the user's gives no `params`, which Keras 2's
        # callbacks then lack.
        params = getattr(self, "params", None)
        steps = params.get("steps") if params else None
        if steps:
            steps = adapter.loop.micro_steps_in_epoch(
                steps, adapter.loop.steps_per_execution(model)
            )
        model._accumulation.start_epoch(steps, epoch)
        length = model._accumulation.window_length()
        # An epoch that begins with a window restored open from a checkpoint
        # is the rest of an interrupted one: its end ends that window where
        # the uninterrupted epoch's end would.
        if (steps and model.flush_each_epoch and steps < length
                and not model._accumulation.open_micro_steps()):
            model._accumulation.warn_once(
                messages.windows_cut_by_epoch(steps, length))
        if not model.flush_each_epoch:
            # A window may run through this epoch without ending in it.
            self._loss_start = model._accumulation.loss_totals()

    def on_test_begin(self, logs=None):
        if self._epoch is not None and self._training_loss is None:
            self.apply_if_epoch_ends_window()
            # `evaluate()` resets the tracker right after this hook.
            self._training_loss = adapter.losses.logged_loss_totals(
                self.accumulating_model)

    def on_epoch_end(self, epoch, logs=None):
        self.apply_if_epoch_ends_window()
        if self._training_loss is None:
            self._training_loss = adapter.losses.logged_loss_totals(
                self.accumulating_model)
        self.log_window_loss(logs)
        self.log_skipped_windows(logs)
        self.log_noise_scale(logs)

    def on_train_end(self, logs=None):
        self.accumulating_model.apply_open_window()
        self.log_skipped_windows(logs)
        self.accumulating_model._accumulation.start_epoch(None)
        self._epoch = None

    def apply_if_epoch_ends_window(self):
        """Applies the open window if the epoch ends it; returns whether
        one was open."""
        model = self.accumulating_model
        last_epoch = self._epoch is not None and self._epoch + 1 >= self.epochs
        if model.flush_each_epoch or last_epoch or model.stop_training:
            if model._accumulation.open_micro_steps():
                self.apply_open_window()
                return True
        return False

    def apply_open_window(self):
        """Applies the open window; its loss joins the epoch's training
        loss where that was read before (validation ran since)."""
        model = self.accumulating_model
        before = adapter.losses.logged_loss_totals(model)
        model.apply_open_window()
        if self._training_loss is not None and before is not None:
            after = adapter.losses.logged_loss_totals(model)
            self._training_loss = tuple(
                kept + now - then
                for kept, now, then in zip(self._training_loss, after, before))

    def log_window_loss(self, logs):
        """Writes the epoch's loss into its logs.

        Keras read it before a window applied at the epoch's end was: the
        logs get the loss with that window in it, as the tracker held it
        before validation. In an epoch where no window ended (a window
        longer than the epoch), Keras's tracker is empty and would log 0.0:
        the logs get the loss of the epoch's micro-batches instead.
        """
        if logs is None or "loss" not in logs:
            return
        model = self.accumulating_model
        loss = None
        totals = self._training_loss
        if totals is not None and totals[1] > 0:
            loss = totals[0] / totals[1]
        if loss is None:
            loss = model._accumulation.loss_since(self._loss_start)
        if loss is not None:
            logs["loss"] = loss

    def log_noise_scale(self, logs):
        model = self.accumulating_model
        if logs is None or not model.measure_noise_scale:
            return
        noise_scale = model._accumulation.noise_scale()
        logs["noise_scale"] = (float("nan") if noise_scale is None
                               else noise_scale)

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None and SKIPPED_WINDOWS in logs:
            logs[SKIPPED_WINDOWS] = WholeCount(logs[SKIPPED_WINDOWS])
        if (logs is not None and "loss" in logs
                and not self._window_ended_in_epoch
                and not adapter.STEP_LOGS_LOSS_BEFORE_A_WINDOW_ENDS
                and threading.current_thread() is self._training_thread):
            self._log_loss_before_a_window_ends(logs)

    def _log_loss_before_a_window_ends(self, logs):
        """Until a window ends in the epoch Keras's loss tracker is empty,
        and the progress bar and callbacks would read 0: they read the loss
        of the epoch's micro-batches so far."""
        model = self.accumulating_model
        totals = adapter.losses.logged_loss_totals(model)
        loss = (None if totals is None or totals[1] > 0
                else model._accumulation.loss_since(self._loss_start))
        if loss is None:
            self._window_ended_in_epoch = True  # nothing more to read
        else:
            logs["loss"] = loss

    def log_skipped_windows(self, logs):
        model = self.accumulating_model
        if logs is not None and SKIPPED_WINDOWS in logs:
            logs[SKIPPED_WINDOWS] = WholeCount(model.skipped_windows)


def _micro_batch_size(arguments):
    """The samples per micro step `fit()` was asked for: its `batch_size`,
    Keras's 32 for arrays without one, None for a dataset or generator."""
    batch_size = arguments.get("batch_size")
    if batch_size is None and samples_in(arguments.get("x")) is not None:
        return 32
    return batch_size


def _window_sizers_first(model, callbacks, batch_size):
    """`callbacks` with each `WindowFromNoiseScale` first (right after the
    window's own callback), so that the epoch's logs hold what it set when
    the user's callbacks read them, each prepared for `model`'s `fit()`
    with micro-batches of `batch_size` before Keras traces the step."""
    if callbacks is None:
        return None
    listed = (callbacks.callbacks
              if isinstance(callbacks, keras.callbacks.CallbackList)
              else list(callbacks))
    sizers = [c for c in listed if isinstance(c, WindowFromNoiseScale)]
    for sizer in sizers:
        sizer.before_fit(model, batch_size)
    ordered = sizers + [c for c in listed
                        if not isinstance(c, WindowFromNoiseScale)]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.callbacks[:] = ordered
        return callbacks
    return ordered


# Log entries that are counts: shown as they stand, never averaged.
COUNTS = (SKIPPED_WINDOWS,)


def _progress_bar_averages():
    """Whether this Keras's progress bar shows a log entry's average over
    the epoch's steps (keras before 3.11 and Keras 2; later Progbars take
    `stateless_metrics` and show each entry as it stands)."""
    return "stateless_metrics" not in inspect.signature(
        keras.utils.Progbar).parameters


def _progress_bar_showing_counts(callbacks):
    """Keras's own progress bar, told that `COUNTS` are not averaged, or
    None when the user passes a progress bar of their own."""
    if isinstance(callbacks, keras.callbacks.CallbackList) or any(
            isinstance(c, keras.callbacks.ProgbarLogger)
            for c in callbacks or []):
        return None
    parameters = inspect.signature(keras.callbacks.ProgbarLogger).parameters
    if "stateful_metrics" in parameters:
        # Keras 2: what its CallbackList itself would add, plus the counts.
        return keras.callbacks.ProgbarLogger(count_mode="steps",
                                             stateful_metrics=list(COUNTS))
    return _CountingProgbarLogger()


class _CountingProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras 3's progress bar, with `COUNTS` among its Progbar's stateful
    metrics (private `_maybe_init_progbar`, checked on keras 3.6 and 3.10)."""

    # As async-safe as the ProgbarLogger Keras adds itself.
    async_safe = True

    def _maybe_init_progbar(self):
        super()._maybe_init_progbar()
        stateful = getattr(self.progbar, "stateful_metrics", None)
        if isinstance(stateful, set):
            stateful.update(COUNTS)


class WholeCount(float):
    """A count in `fit()`'s logs: a float, as Keras's logs hold, that the
    progress bar shows as the whole number it is (keras 3.15's `Progbar`
    divides each value by 1 and formats it with `.4f` or `.4e`; older ones
    convert it to a float first, and show `1.0000`)."""

    def __truediv__(self, other):
        return WholeCount(float(self) / other)

    def __format__(self, spec):
        return str(int(self))


class _StoppedWindowCallback(keras.callbacks.Callback):
    """Runs after user callbacks: applies the window if one stopped training.

    A callback such as `EarlyStopping` sets `stop_training` in its own
    `on_epoch_end`, after `WindowCallback`'s; the window carried over
    (`flush_each_epoch=False`) must still be applied before Keras finalizes
    the optimizer (e.g. writes EMA weights) and returns.
    """

    def __init__(self, window_callback):
        super().__init__()
        self.window_callback = window_callback

    def on_epoch_end(self, epoch, logs=None):
        window_callback = self.window_callback
        model = window_callback.accumulating_model
        if model.stop_training and model._accumulation.open_micro_steps():
            window_callback.apply_open_window()
            window_callback.log_window_loss(logs)
            window_callback.log_skipped_windows(logs)
            window_callback.log_noise_scale(logs)


def _fit_argument_error(error, kwargs):
    """Keras's own message for arguments `fit()` does not take, and where a
    keyword of `compile()` belongs."""
    settings = sorted(set(kwargs) & set(Settings.DEFAULTS))
    if settings:
        name = settings[0]
        return (f"fit() got an unexpected keyword argument {name!r}: it is "
                "a setting of the model, given to its constructor, to "
                f"`accumulating(model, {name}=...)` or as `model.{name} = "
                f"...` before fit(). Received: {name}={kwargs[name]!r} in "
                "fit()")
    compile_keywords = set(inspect.signature(keras.Model.compile).parameters)
    misplaced = sorted(set(kwargs) & compile_keywords)
    if not misplaced:
        return f"fit() got arguments it does not take: {error}"
    name = misplaced[0]
    return (f"fit() got an unexpected keyword argument {name!r}: it is an "
            f"argument of compile(). Received: {name}={kwargs[name]!r} in "
            "fit()")
