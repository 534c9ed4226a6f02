"""What every backend's micro step decides alike (`core.micro_step`), on
plain Python: whether the window divides by its weight, and the skipped
windows' log entry."""

import pytest

from accum_model.core import divisor
from accum_model.core import micro_step
from accum_model.core import window


class Base:
    """Stands for AccumulatingModel: the class that marks itself."""

    _accum_model_base = True

    def micro_batch_weight(self, x, y, y_pred, sample_weight):
        return 1.0


class Subclass(Base):
    pass


class OwnWeight(Base):
    def micro_batch_weight(self, x, y, y_pred, sample_weight):
        return 2.0


def _reductions(*names):
    return [divisor.Reduction(name, None, False) for name in names]


def test_a_window_of_summed_losses_divides_by_nothing():
    assert not micro_step.divides_by_weight(Subclass, False,
                                            _reductions("sum", "sum"))


def test_one_mean_term_makes_the_window_divide():
    assert micro_step.divides_by_weight(
        Subclass, False, _reductions("sum", "sum_over_batch_size"))
    # A step that recorded no reduction (a loss Keras did not reduce).
    assert micro_step.divides_by_weight(Subclass, False, [])


def test_a_weight_of_ones_own_or_of_samples_always_divides():
    summed = _reductions("sum")
    assert micro_step.divides_by_weight(OwnWeight, False, summed)
    assert micro_step.divides_by_weight(Subclass, True, summed)


def test_skipped_windows_are_shown_wherever_a_window_can_be_skipped():
    assert micro_step.shows_skipped_windows(True, False)
    assert micro_step.shows_skipped_windows(False, True)
    assert not micro_step.shows_skipped_windows(False, False)


@pytest.mark.parametrize("loss_scaled", [False, True])
@pytest.mark.parametrize("narrow", [False, True])
def test_the_logs_count_skips_exactly_where_the_end_checks(loss_scaled,
                                                           narrow):
    # A window the end's checks can skip is one the logs must count.
    assert micro_step.shows_skipped_windows(loss_scaled, narrow) is bool(
        window.end_checks(loss_scaled, narrow))


def test_the_skipped_windows_entry_joins_the_logs_without_changing_them():
    logs = {"loss": 0.5}
    shown = micro_step.with_skipped_windows(logs, 2)
    assert shown == {"loss": 0.5, micro_step.SKIPPED_WINDOWS: 2}
    assert logs == {"loss": 0.5}
