"""What every backend's micro step decides alike (`core.micro_step`), on
plain Python: whether the window divides by its weight, what a step keeps
of its loss's reductions, and the skipped windows' log entry."""

import numpy as np
import pytest

from accum_model.core import divisor
from accum_model.core import micro_step
from accum_model.core import window
from accum_model.core.settings import Settings


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


def _settings(narrow):
    return Settings(accumulator_dtype="float16" if narrow else "float32")


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
    assert micro_step.shows_skipped_windows(True, _settings(False))
    assert micro_step.shows_skipped_windows(False, _settings(True))
    assert not micro_step.shows_skipped_windows(False, _settings(False))


@pytest.mark.parametrize("loss_scaled", [False, True])
@pytest.mark.parametrize("narrow", [False, True])
def test_the_logs_count_skips_exactly_where_the_end_checks(loss_scaled,
                                                           narrow):
    # A window the end's checks can skip is one the logs must count.
    assert micro_step.shows_skipped_windows(
        loss_scaled, _settings(narrow)) is bool(
        window.end_checks(loss_scaled, _settings(narrow)))


@pytest.mark.parametrize("loss_scaled", [False, True])
def test_the_logs_count_skips_only_where_a_window_can_be_skipped(
        loss_scaled):
    logs = {"loss": 0.5}
    reads = []

    def skipped_windows():
        reads.append(True)
        return 2

    shown = micro_step.logged(logs, skipped_windows, loss_scaled,
                              _settings(False))
    if loss_scaled:
        assert shown == {"loss": 0.5, micro_step.SKIPPED_WINDOWS: 2}
    else:
        # Not even read: a step that cannot skip reads no counter.
        assert shown == logs and not reads
    assert logs == {"loss": 0.5}


class _Accumulation:
    weight_from_batch_size = False

    def __init__(self):
        self.elements_per_sample_seen = {}
        self.warnings = []

    def warn_once(self, message, *args, **kwargs):
        self.warnings.append(message)


_NUMPY_SHAPES = divisor.ShapeOps(
    convert=np.asarray, count=lambda t: np.float32(np.size(t)),
    count_true=lambda m: np.float32(np.sum(m)),
    first_dimension=lambda t: np.shape(t)[0],
    leading_elements=lambda t: np.float32(np.prod(np.shape(t)[:-1])),
    flatten=lambda s: list(s) if isinstance(s, (list, tuple)) else [s],
    to_float32=np.float32)


def test_a_reduced_loss_is_kept_for_the_weight_and_decides_the_divisor():
    model = Subclass()
    model._accumulation = _Accumulation()
    model.losses = []
    model._flatten_layers = lambda: [model]
    y_pred = np.zeros((4, 3), "float32")
    summed = _reductions("sum")
    assert not micro_step.loss_reduced(model, summed, y_pred,
                                       lambda output: None, _NUMPY_SHAPES)
    assert model._traced_loss_reductions is summed
    assert micro_step.loss_reduced(
        model, _reductions("sum_over_batch_size"), y_pred,
        lambda output: None, _NUMPY_SHAPES)
    assert not model._accumulation.warnings


def test_a_scalar_loss_keeps_the_rows_it_was_taken_over():
    # Replicas' scalars of one's own are averaged by their samples in
    # evaluation (`replicas.reduced_as_one_device`); a loss of per-element
    # values has a divisor instead.
    prediction = np.zeros((5, 3), "float32")
    scalar = divisor.reduction_of(np.float32(0.7), "sum_over_batch_size",
                                  _NUMPY_SHAPES, prediction=prediction)
    assert scalar.divisor is None and scalar.samples == 5
    per_element = divisor.reduction_of(
        np.ones((5, 3), "float32"), "sum_over_batch_size", _NUMPY_SHAPES,
        prediction=prediction)
    assert per_element.samples is None and per_element.divisor == 15
    unknown = divisor.reduction_of(np.float32(0.7), "sum_over_batch_size",
                                   _NUMPY_SHAPES)
    assert unknown.divisor is None and unknown.samples is None
