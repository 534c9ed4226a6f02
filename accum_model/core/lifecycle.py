"""The window's life cycle, shared by every backend's `Accumulation`.

What the model, its callbacks and users ask of an accumulation is the same
on every backend: the settings in force and when they may change, the
epoch, the micro steps an open window holds (or a restored file holds
before the window exists), the loss of part of a window. A backend's
`Accumulation` subclasses `WindowLifecycle` and answers the few questions
only its state can: its state's values (`_window_value`), whether its micro steps handed in their loss, and how
its window takes a new length.
"""

import warnings

from accum_model.core import arithmetic
from accum_model.core import micro_step
from accum_model.core.messages import user_stacklevel
from accum_model.core.messages import window_is_open


class WindowLifecycle:
    """Settings, epochs and the questions every backend answers alike.

    Args:
        settings: The `Settings` to accumulate with.

    Attributes:
        settings: The `Settings` in force.
        window: The backend's window, or None before training builds it.
        loss_scaling: The compiled optimizer's duties (the adapter's
            `LossScaling`), or None before training is set up.
        checkpoint: The `WindowCheckpoint` that files carry, set by the
            model (its class depends on the Keras and the backend).
        update_signal: What callbacks read to learn whether a run of the
            train function applied an update (set by the backend).
        epoch: Int. The 0-based epoch being trained.
        weight_from_batch_size: Bool. Whether micro-batches are weighted by
            their number of samples (a loss whose divisor is unknown).
        own_step_feeds_window: Bool. Whether the model's own `train_step`
            hands its gradients to the window, which it then keeps even in
            windows of 1 (Keras's step would never reach it).
        several_replicas: Bool. Whether the model trains on several
            replicas of a `tf.distribute` strategy, where it keeps windows
            of 1 too: Keras's own step strays there from the one-device
            large batch (it clips each replica's share, and averages the
            replicas' means of a masked or `ignore_class` loss).
        micro_batches_in_step: Int (or a scalar of the backend, traced):
            the micro-batches the step being run splits its batch into
            (`micro_batch_size`); 1 outside such a step.
    """

    def __init__(self, settings):
        self.settings = settings
        self.window = None
        self.loss_scaling = None
        self.checkpoint = None
        self.epoch = 0
        self.weight_from_batch_size = False
        self.own_step_feeds_window = False
        self.several_replicas = False
        self.micro_batches_in_step = 1
        # `micro_batch_size="auto"`'s choices, by the batch's shapes.
        self.chosen_micro_batch_sizes = {}
        # The loss elements per sample each loss term met in the micro
        # steps (see `divisor.warn_if_padded_length_varies`).
        self.elements_per_sample_seen = {}
        # The layers whose `add_loss` terms are means over the samples
        # (`_checks.warn_if_layers_add_losses`).
        self.layers_adding_means = []
        # The compiled loss functions of the user's that return their
        # batch's mean as one number (`_checks.note_losses_that_are_means`).
        self.mean_loss_functions = []
        # Micro steps in the current epoch, or -1 when unknown or when
        # windows carry across epochs.
        self._epoch_steps = -1
        self._warned = set()

    def warn_once(self, message):
        """Warns with `message` once for this model (later fits are quiet)."""
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=user_stacklevel())

    # Settings --------------------------------------------------------------

    @property
    def accumulates(self):
        return self.settings.accumulates or self._keeps_windows_of_one()

    def _keeps_windows_of_one(self):
        return self.own_step_feeds_window or self.several_replicas

    def window_length(self):
        """Int. Micro-batches per window in the current epoch."""
        return self.settings.length_for_epoch(self.epoch)

    def reconfigure(self, settings):
        """Takes new settings, at a window boundary only.

        Returns:
            Whether the training step must be traced anew (settings other
            than `n_gradients` changed, or whether it accumulates).

        Raises:
            ValueError: A window is open and the settings differ.
        """
        if settings == self.settings:
            return False
        open_steps = self.open_micro_steps()
        if open_steps:
            changed = ", ".join(
                f"{name}={value!r}"
                for name, value in settings.as_dict().items()
                if value != self.settings.as_dict()[name]
            )
            raise ValueError(
                "The accumulation settings can only change at a window "
                f"boundary, and the model has {window_is_open(open_steps)}. "
                f"Received: {changed}"
            )
        self._check_settings(settings)
        if (settings.accumulator_dtype != self.settings.accumulator_dtype
                or settings.measure_noise_scale
                != self.settings.measure_noise_scale):
            # The next step builds the window anew, in the new dtype, with
            # or without the noise scale.
            self._forget_window()
        # The window's length is a value the step reads, not part of its
        # trace: a new length alone (accumulating before and after) keeps
        # the traced step, so that it can change between two epochs of one
        # fit().
        retrace = ((settings.accumulates != self.settings.accumulates
                    and not self._keeps_windows_of_one())
                   or _without_length(settings)
                   != _without_length(self.settings))
        self.settings = settings
        self.chosen_micro_batch_sizes = {}
        if self.window is not None:
            self._set_window_length(self.window_length())
        return retrace

    def _start_epoch_counts(self, steps, epoch):
        """Notes the epoch and its micro steps (known only where windows end
        with the epoch)."""
        known = self.settings.flush_each_epoch and steps
        self._epoch_steps = int(steps) if known else -1
        if epoch is not None:
            self.epoch = epoch

    def set_up(self, loss_scaling, run_eagerly, report_loss=None,
               float16_gradients=None):
        """Decides, once per compiled set-up, how windows are applied.

        Args:
            loss_scaling: The compiled optimizer's duties.
            run_eagerly: Bool. Whether the model trains eagerly.
            report_loss: Callable `(loss, samples)` that logs a window's
                loss, or None.
            float16_gradients: Callable taking the trainable variables and
                returning, for each, whether the large batch's gradient of
                it is float16; or None (none is).
        """
        raise NotImplementedError

    def micro_batch_size_for(self, shapes, batch_size, fits, limit):
        """Int: the micro-batch size for a batch of `batch_size` samples
        (per replica) whose arrays have `shapes`: `micro_batch_size`, or
        under "auto" the largest that `fits`, chosen once per `shapes`
        and said in one line.

        Args:
            shapes: Hashable, the batch's shapes.
            batch_size: Int. The samples a replica's step splits.
            fits: Callable `(size) -> bool`.
            limit: Str, what `fits` holds a size to (for the messages).

        Raises:
            ValueError: Not even a micro-batch of one sample fits.
        """
        size = self.settings.micro_batch_size
        if size != "auto":
            return size
        chosen = self.chosen_micro_batch_sizes.get(shapes)
        if chosen is None:
            chosen = micro_step.largest_fitting(batch_size, fits)
            if chosen is None:
                raise ValueError(
                    "micro_batch_size=\"auto\" found no micro-batch that "
                    f"fits {limit}: a training step on one sample does not. "
                    "Give the step more memory (`memory_limit` on JAX), or a "
                    "smaller model. Received: micro_batch_size=\"auto\", "
                    f"memory_limit={self.settings.memory_limit!r}")
            self.chosen_micro_batch_sizes[shapes] = chosen
            print(f"micro_batch_size=\"auto\": batches of {batch_size} "
                  f"samples train in micro-batches of {chosen} ({limit}).")
        return chosen

    # What users read -------------------------------------------------------

    def watch_updates(self, train_function, optimizer):
        """`train_function`, noting the updates applied before each run."""
        return self.update_signal.watching(train_function, optimizer)

    def window_left_open(self):
        """Micro-batches of an open window that no checkpoint restored.

        Such a window was left by `train_on_batch` or a loop driven by hand
        (or a `fit()` that raised); a window restored from a checkpoint is
        one that training means to continue. Asking clears the restored
        count: the next question is about what happens after it.
        """
        open_steps = self.open_micro_steps()
        restored = self.checkpoint.restored_micro_steps
        self.checkpoint.restored_micro_steps = 0
        return 0 if open_steps == restored else open_steps

    def open_micro_steps(self):
        """Int. Micro-batches accumulated and not yet applied."""
        if self.window is None:
            return self.checkpoint.pending_count("micro_steps")
        return self._window_count("micro_steps")

    def skipped_windows(self):
        """Int. Windows skipped because a gradient overflowed."""
        if self.window is None:
            return self.checkpoint.pending_count("skipped_windows")
        return self._window_count("skipped_windows")

    def loss_since(self, start):
        """The loss of the micro-batches added since `start` (eagerly).

        Weighted as their window weighs them: the loss of those
        micro-batches as one batch, a part of the open window. Valid while
        no window ended since `start` was read from `loss_totals()`.

        Returns:
            A float, or None where no micro step was added or none handed in
            its loss (a `train_step` of the user's own logs its own).
        """
        if self.window is None or not self._tracks_loss():
            return None
        loss_sum, weight_sum, micro_steps = (
            now - before for now, before in zip(self.loss_totals(), start)
        )
        if micro_steps <= 0:
            return None
        return arithmetic.loss_of_part(loss_sum, weight_sum,
                                       self._divides_by_weight())

    # What a backend answers ------------------------------------------------

    def loss_totals(self):
        """The open window's loss sum, weight sum (over replicas) and micro
        steps, eagerly: zeros without a window."""
        micro_steps = 0 if self.window is None else self.open_micro_steps()
        if not micro_steps:
            # An emptied window's sums are zeros wherever the store leaves
            # them (the stateless store lets the next micro step write over
            # them).
            return 0.0, 0.0, 0
        return (self._window_value("loss_sum"),
                self._window_value("weight_sum"), micro_steps)

    def noise_scale(self):
        """Float, the gradient noise scale measured in the current epoch.

        None when not measured (`measure_noise_scale` off, or no window of
        two or more micro-batches applied yet this epoch); see
        `arithmetic.noise_scale`.
        """
        if self.window is None or not self.settings.measure_noise_scale:
            return None
        return arithmetic.noise_scale(*(
            self._window_value(name) for name in (
                "noise_trace_sum", "noise_signal_sum", "noise_estimates")))

    def spectral_writes(self):
        """When a `SpectralNormalization` layer's writes land in a window:
        `(vector_u's, the kernel's)`, each a callable returning whether
        the micro step being run writes it (see
        `keras3.normalization.normalized_once_per_window`). Where the
        layer's writes persist, both in the window's first micro step."""
        return self.opens_window, self.opens_window

    def opens_window(self):
        """Bool scalar: whether the micro step being run is its window's
        first."""
        raise NotImplementedError

    def _window_count(self, name):
        """Int. The window's counter `name` ("micro_steps", ...)."""
        return int(self._window_value(name))

    def _window_value(self, name):
        """Float. The window's `WindowState` field `name`, eagerly (a sum
        over replicas where replicas keep their own)."""
        raise NotImplementedError

    def _tracks_loss(self):
        """Whether micro steps hand in their loss."""
        raise NotImplementedError

    def _divides_by_weight(self):
        """False for losses reduced with "sum" (the window is their sum)."""
        raise NotImplementedError

    def _check_settings(self, settings):
        """Raises for settings the backend cannot carry (nothing here)."""
        del settings

    def _forget_window(self):
        """Drops the window so that the next step builds it anew."""
        self.window = None

    def _set_window_length(self, length):
        """Gives the window `length` from its next boundary (eagerly)."""
        raise NotImplementedError


def _without_length(settings):
    return {name: value for name, value in settings.as_dict().items()
            if name != "n_gradients"}
