"""Whether the micro-batch just trained ended with an optimizer update."""

import tensorflow as tf


class TensorFlowUpdateSignal:
    """Whether the last run of the train function applied an update.

    Before each run of the train function (one micro-batch, or
    `steps_per_execution` of them) the count of applied updates is copied,
    on the device, without waiting for it; `applied()` compares it with the
    count now, so only reading the signal waits for the step to finish.

    Args:
        count_updates: Callable returning the updates applied so far, as a
            tensor: the optimizer's `iterations`, less the skipped windows
            where the Keras counts a skipped step in it (Keras 2).
    """

    def __init__(self, count_updates):
        self._count_updates = count_updates
        self._count_before = None

    def watching(self, train_function):
        """Wraps `train_function` to note the count before each run."""

        def train_function_noting_updates(iterator):
            self._count_before = tf.convert_to_tensor(self._count_updates())
            return train_function(iterator)

        return train_function_noting_updates

    def applied(self):
        if self._count_before is None:
            return False
        now = int(tf.convert_to_tensor(self._count_updates()).numpy())
        return now > int(self._count_before.numpy())
