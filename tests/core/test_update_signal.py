"""`core.update_signal`: whether a run of the train function applied an
update, from the count copied before it and the count after."""

import numpy as np

from accum_model.core.update_signal import UpdateSignal


class _Optimizer:
    def __init__(self):
        self.iterations = np.zeros((), np.int64)


def _train_function(optimizer, updates):
    def run(*args):
        optimizer.iterations += updates
        return args

    return run


def test_a_run_that_updates_is_seen_and_one_that_does_not_is_not():
    optimizer = _Optimizer()
    signal = UpdateSignal(lambda o: o.iterations, np.copy)
    assert not signal.applied()  # nothing ran yet
    updating = signal.watching(_train_function(optimizer, 1), optimizer)
    assert updating("batch") == ("batch",)
    assert signal.applied()
    quiet = signal.watching(_train_function(optimizer, 0), optimizer)
    quiet("batch")
    assert not signal.applied()


def test_the_count_is_copied_before_the_run_not_referenced():
    # A count the run changes in place must not read as the count before.
    optimizer = _Optimizer()
    signal = UpdateSignal(lambda o: o.iterations, lambda value: value)
    signal.watching(_train_function(optimizer, 1), optimizer)("batch")
    assert not signal.applied()  # the uncopied count moved with the run
    copying = UpdateSignal(lambda o: o.iterations, np.copy)
    copying.watching(_train_function(optimizer, 1), optimizer)("batch")
    assert copying.applied()
