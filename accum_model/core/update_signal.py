"""Whether the last run of the train function applied an update."""


class UpdateSignal:
    """Whether the last run of the train function applied an update.

    Before each run of the train function (one micro-batch, or
    `steps_per_execution` of them) the count of applied updates is copied,
    on the device, without waiting for it; `applied()` compares it with the
    count now, so only reading the signal waits for the step to finish.

    Args:
        count_updates: Callable `(optimizer) -> scalar`: the updates
            applied so far, as the backend's scalar.
        copy: Callable copying such a scalar on the device.
    """

    def __init__(self, count_updates, copy):
        self._count_updates = count_updates
        self._copy = copy
        self._optimizer = None
        self._count_before = None

    def watching(self, train_function, optimizer):
        """Wraps `train_function` to note the count before each run."""
        self._optimizer = optimizer

        def train_function_noting_updates(*args):
            self._count_before = self._copy(self._count_updates(optimizer))
            return train_function(*args)

        return train_function_noting_updates

    def applied(self):
        return (self._count_before is not None
                and int(self._count_updates(self._optimizer))
                > int(self._count_before))
