"""A window that sizes itself: `n_gradients` follows the gradient noise scale.

`WindowFromNoiseScale` reads each epoch's `noise_scale` (see
docs/noise-scale.md), smooths it across epochs, and sets the next epoch's
`n_gradients` so that the window `n * b` follows it; optionally it moves
the learning rate with the window.
"""

import math

from accum_model._chooser import adapter
from accum_model._chooser import keras

__all__ = ["WindowFromNoiseScale"]

LEARNING_RATE_RULES = (None, "linear", "sqrt", "adascale")

# The entries each epoch's logs get, for History, CSVLogger and TensorBoard.
LOGGED = ("smoothed_noise_scale", "window_n_gradients",
          "window_learning_rate")


class WindowFromNoiseScale(keras.callbacks.Callback):
    """Sets `n_gradients` each epoch from the measured gradient noise scale.

    At the end of each epoch it reads the epoch's `noise_scale` (B_noise,
    in the units the loss averages over: samples for most losses), smooths
    it across epochs as a moving average of its logarithm,

        log S_e = smoothing * log S_(e-1) + (1 - smoothing) * log B_e,

    and sets the next epoch's `n_gradients` to the power of two nearest (on
    a log scale) to S_e / b, within `[min_n_gradients, max_n_gradients]`,
    so that the window `n * b` follows the critical batch. An epoch whose
    noise scale is unresolved (0, `inf` or NaN) leaves the window and the
    smoothed value as they were. The window changes only between epochs,
    where `fit()` applies the open window (`flush_each_epoch=True`).

    With `learning_rate` set, the optimizer's learning rate follows the
    window, relative to the learning rate and window the training started
    with (n0 and lr0; the window's scale r = n / n0). A float learning rate
    is set; a `LearningRateSchedule` keeps running on the optimizer's
    updates and is multiplied by the factor (it is wrapped, once, in a
    schedule that holds the factor and is saved with the optimizer):

    - `None`: left as it is;
    - `"linear"`: lr0 * r, the linear scaling rule (SGD, batches below the
      noise scale);
    - `"sqrt"`: lr0 * sqrt(r) (Adam and other adaptive optimizers);
    - `"adascale"`: lr0 times AdaScale's gain ratio (Johnson et al., ICML
      2020) from the same estimate, (1 + S/B0) / (1 + S/(r * B0)) with B0 =
      n0 * b: close to r while the window is far below the noise scale,
      close to 1 far above it.

    Each epoch's logs get `smoothed_noise_scale`, `window_n_gradients` and
    `window_learning_rate`: the values set for the next epoch (the
    learning rate is the one the next update applies).

    Args:
        min_n_gradients: Int >= 2, the smallest window (a window of one
            micro-batch measures no noise scale).
        max_n_gradients: Int >= `min_n_gradients`, the largest window.
        learning_rate: One of None, "linear", "sqrt", "adascale".
        smoothing: Float in [0, 1): the weight of the past in the moving
            average (0: each epoch's own value).
        micro_batch_size: The micro-batch's size b in the noise scale's
            units, or None for `fit()`'s `batch_size` (samples). Give it for
            data without a `batch_size` (a dataset or generator), or for a
            loss that averages over tokens (the valid tokens per
            micro-batch).

    Raises:
        ValueError: For bounds, a rule or a smoothing out of range (here),
            and before training for a model that does not accumulate or
            does not measure the noise scale, an `n_gradients` schedule, a
            rule for a learning rate that is a bare callable, an unknown
            micro-batch size, or `flush_each_epoch=False`.
    """

    def __init__(self, min_n_gradients=2, max_n_gradients=64,
                 learning_rate=None, smoothing=0.5, micro_batch_size=None):
        super().__init__()
        for name, value in (("min_n_gradients", min_n_gradients),
                            ("max_n_gradients", max_n_gradients)):
            if not _is_int(value) or value < 2:
                raise ValueError(
                    f"`{name}` must be an int >= 2 (a window of one "
                    "micro-batch measures no noise scale). Received: "
                    f"{name}={value!r}")
        if max_n_gradients < min_n_gradients:
            raise ValueError(
                "`max_n_gradients` must be >= `min_n_gradients`. Received: "
                f"min_n_gradients={min_n_gradients}, "
                f"max_n_gradients={max_n_gradients}")
        if learning_rate not in LEARNING_RATE_RULES:
            raise ValueError(
                "`learning_rate` must be one of "
                f"{', '.join(repr(r) for r in LEARNING_RATE_RULES)}. "
                f"Received: learning_rate={learning_rate!r}")
        if not (isinstance(smoothing, (int, float))
                and not isinstance(smoothing, bool)
                and 0.0 <= smoothing < 1.0):
            raise ValueError(
                "`smoothing` must be a float in [0, 1). Received: "
                f"smoothing={smoothing!r}")
        if micro_batch_size is not None and not (
                isinstance(micro_batch_size, (int, float))
                and micro_batch_size > 0):
            raise ValueError(
                "`micro_batch_size` must be a positive number or None. "
                f"Received: micro_batch_size={micro_batch_size!r}")
        self.min_n_gradients = int(min_n_gradients)
        self.max_n_gradients = int(max_n_gradients)
        self.learning_rate = learning_rate
        self.smoothing = float(smoothing)
        self.micro_batch_size = micro_batch_size
        # Set as training begins (see `fit_batch_size` there).
        self.fit_batch_size = None
        self.smoothed_noise_scale = None
        self.start_n_gradients = None
        # What the rule scales as training started: the float learning
        # rate, or the factor on a schedule.
        self.start_learning_rate = None
        # The optimizer's learning rate or schedule factor, as the adapter
        # reads and sets it (found as training begins).
        self._scaled = None
        self._adopted = False

    # Before training ---------------------------------------------------------

    def before_fit(self, model, batch_size):
        """Called by the accumulating model's `fit()` before Keras traces
        its step: takes `fit()`'s micro-batch size, and puts the scale on a
        learning-rate schedule now, so that the step traced is the scaled
        one (a step traced before, by an earlier `fit()`, is traced anew).
        Anything it cannot scale is refused in `on_train_begin`."""
        self.fit_batch_size = batch_size
        if (self.learning_rate is not None
                and getattr(model, "optimizer", None) is not None):
            try:
                adapter.learning_rate.scalable_learning_rate(model)
            except ValueError:
                pass  # Refused by `on_train_begin`, with the callbacks'.

    def on_train_begin(self, logs=None):
        model = self.model
        n_gradients = getattr(model, "n_gradients", None)
        if n_gradients is None or not hasattr(model, "_accumulation"):
            raise ValueError(
                "WindowFromNoiseScale sizes the window of an accumulating "
                "model: use AccumulatingModel or accumulating(model, "
                f"n_gradients=2, measure_noise_scale=True). Received: a "
                f"{type(model).__name__}")
        if not model.measure_noise_scale:
            raise ValueError(
                "WindowFromNoiseScale reads the noise scale each epoch: "
                "build the model with measure_noise_scale=True. Received: "
                "measure_noise_scale=False")
        if isinstance(n_gradients, dict):
            raise ValueError(
                "WindowFromNoiseScale sets n_gradients itself: start from an "
                "int, e.g. n_gradients=2. Received: "
                f"n_gradients={n_gradients!r}")
        if not model.flush_each_epoch:
            raise ValueError(
                "WindowFromNoiseScale changes the window between epochs, "
                "where fit() applies the open window: use "
                "flush_each_epoch=True. Received: flush_each_epoch=False")
        self._micro_batch()
        self._adopted = False
        if self.start_n_gradients is None:
            self.start_n_gradients = n_gradients
        if self.learning_rate is not None:
            self._scaled = adapter.learning_rate.scalable_learning_rate(model)
            if self._scaled is None:
                raise ValueError(
                    f"learning_rate={self.learning_rate!r} scales a float "
                    "learning rate or a keras LearningRateSchedule, and this "
                    "optimizer's learning rate is a callable, which has no "
                    "scale to set. Write it as a LearningRateSchedule "
                    "subclass, or use learning_rate=None and let it run. "
                    f"Received: {type(model.optimizer).__name__}"
                    "(learning_rate=<callable>)")
            if self.start_learning_rate is None:
                self.start_learning_rate = self._scaled.value()

    def _micro_batch(self):
        """b, in the noise scale's units; raises where it is unknown."""
        size = self.micro_batch_size or self.fit_batch_size
        if size is None:
            raise ValueError(
                "WindowFromNoiseScale needs the micro-batch's size to turn "
                "the noise scale into a number of micro-batches, and fit() "
                "was given no batch_size (a dataset or a generator): pass "
                "micro_batch_size=... (samples, or what the loss averages "
                "over). Received: micro_batch_size=None")
        return float(size)

    # Between epochs ----------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        # A checkpoint restored as training began (`BackupAndRestore` loads
        # in its own `on_train_begin`) carries the state this callback had
        # when it was saved: the training goes on from there, rather than
        # from the restored learning rate as if it were the starting one.
        if self._adopted:
            return
        self._adopted = True
        saved = getattr(self.model, "_window_checkpoint", None)
        state = getattr(saved, "sizer_state", None)
        if state is None:
            return
        smoothed, start_n, start_learning_rate, n_gradients = (
            float(v) for v in state)
        self.smoothed_noise_scale = (None if math.isnan(smoothed)
                                     else smoothed)
        self.start_n_gradients = int(start_n)
        if not math.isnan(start_learning_rate):
            self.start_learning_rate = start_learning_rate
        if int(n_gradients) != self.model.n_gradients:
            self.model.n_gradients = int(n_gradients)
        if self._scaled is not None:
            # A float learning rate comes back with the optimizer's
            # variables; a schedule's factor does not.
            self._scaled.set(self._scaled_value(int(n_gradients)))

    def on_epoch_end(self, epoch, logs=None):
        model = self.model
        measured = (logs or {}).get("noise_scale")
        if _resolved(measured):
            log_value = math.log(float(measured))
            if self.smoothed_noise_scale is not None:
                log_value = (self.smoothing
                             * math.log(self.smoothed_noise_scale)
                             + (1.0 - self.smoothing) * log_value)
            self.smoothed_noise_scale = math.exp(log_value)
            n_gradients = self.window_for(self.smoothed_noise_scale)
            if n_gradients != model.n_gradients:
                model.n_gradients = n_gradients
            if self._scaled is not None:
                self._scaled.set(self._scaled_value(n_gradients))
        model._window_checkpoint.sizer_state = [
            math.nan if self.smoothed_noise_scale is None
            else self.smoothed_noise_scale,
            self.start_n_gradients,
            math.nan if self.start_learning_rate is None
            else self.start_learning_rate,
            model.n_gradients]
        if logs is not None:
            logs["smoothed_noise_scale"] = (
                float("nan") if self.smoothed_noise_scale is None
                else self.smoothed_noise_scale)
            logs["window_n_gradients"] = model.n_gradients
            learning_rate = adapter.learning_rate.learning_rate_of(
                model.optimizer)
            logs["window_learning_rate"] = (
                float("nan") if learning_rate is None else learning_rate)

    def window_for(self, noise_scale):
        """Int. The window length for a (smoothed) noise scale: the power of
        two nearest to `noise_scale / b`, within the bounds."""
        ratio = noise_scale / self._micro_batch()
        nearest = 2 ** round(math.log2(ratio)) if ratio > 0 else 1
        return int(min(self.max_n_gradients,
                       max(self.min_n_gradients, nearest)))

    def _scaled_value(self, n_gradients):
        """The learning rate, or a schedule's factor, for `n_gradients`."""
        if self.smoothed_noise_scale is None:
            return self.start_learning_rate
        return (self.start_learning_rate
                * self.learning_rate_scale(n_gradients))

    def learning_rate_scale(self, n_gradients):
        """Float. lr / lr0 for a window of `n_gradients` (see the class)."""
        scale = n_gradients / self.start_n_gradients
        if self.learning_rate == "linear":
            return scale
        if self.learning_rate == "sqrt":
            return math.sqrt(scale)
        if self.learning_rate == "adascale":
            start_batch = self.start_n_gradients * self._micro_batch()
            noise = self.smoothed_noise_scale
            return ((1.0 + noise / start_batch)
                    / (1.0 + noise / (scale * start_batch)))
        return 1.0


def _resolved(value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(value) and value > 0


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)
