"""The callback that tells the training step where epochs end."""

import keras


class WindowCallback(keras.callbacks.Callback):
    """Keeps windows aligned with `fit()`'s epochs; runs before user callbacks.

    Args:
        accumulating_model: The `AccumulatingModel` being fitted.
    """

    def __init__(self, accumulating_model):
        super().__init__()
        self.accumulating_model = accumulating_model

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps") if self.params else None
        self.accumulating_model._start_epoch(steps)

    def on_epoch_end(self, epoch, logs=None):
        # The training step applies the open window on the epoch's last
        # micro step when the epoch length is known, and the train function
        # applies it when the data runs out. This catches what remains, e.g.
        # an epoch cut short by `stop_training`.
        if self.accumulating_model.flush_each_epoch:
            self.accumulating_model.apply_open_window()

    def on_train_end(self, logs=None):
        self.accumulating_model.apply_open_window()
