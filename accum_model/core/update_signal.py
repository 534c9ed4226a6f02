"""Whether the micro-batch just trained ended with an optimizer update."""

import tensorflow as tf


class UpdateSignal:
    """Whether the last run of the train function applied an update.

    Before each run of the train function (one micro-batch, or
    `steps_per_execution` of them) the optimizer's update count is copied,
    on the device, without waiting for it; `applied()` compares it with the
    count now, so only reading the signal waits for the step to finish.
    """

    def __init__(self):
        self._count_before = None
        self._optimizer = None

    def watching(self, train_function, optimizer):
        """Wraps `train_function` to note the count before each run."""

        def train_function_noting_updates(iterator):
            self._optimizer = optimizer
            self._count_before = tf.convert_to_tensor(_updates(optimizer))
            return train_function(iterator)

        return train_function_noting_updates

    def applied(self):
        if self._count_before is None:
            return False
        now = int(tf.convert_to_tensor(_updates(self._optimizer)).numpy())
        return now > int(self._count_before.numpy())


def _updates(optimizer):
    # Under loss scaling the inner optimizer counts the updates applied
    # (before keras 3.9 the outer one keeps a count of its own).
    return getattr(optimizer, "inner_optimizer", optimizer).iterations
