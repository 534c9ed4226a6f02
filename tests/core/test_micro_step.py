"""What every backend's micro step decides alike (`core.micro_step`), on
plain Python: whether the window divides by its weight, what a step keeps
of its loss's reductions, and the skipped windows' log entry."""

import numpy as np
import pytest

from accum_model.core import arithmetic
from accum_model.core import divisor
from accum_model.core import micro_step
from accum_model.core import window
from accum_model.core.numpy_ops import NUMPY_OPS
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
        self.layers_adding_means = []
        self.mean_loss_functions = []
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


def _scalar_loss(y_true, y_pred):
    return np.mean(np.square(y_true - y_pred))


@pytest.mark.parametrize("found_a_mean, weighted, warned", [
    (False, False, True), (True, False, False), (True, True, True)])
def test_a_scalar_loss_found_a_mean_is_weighed_without_a_warning(
        found_a_mean, weighted, warned):
    # One number per micro-batch: warned, unless the loss was found to be
    # its batch's mean over samples and nothing weighed its values.
    reductions = [divisor.reduction_of(
        np.float32(0.5), "sum_over_batch_size", _NUMPY_SHAPES,
        loss=type("Wrapper", (), {"fn": staticmethod(_scalar_loss)})(),
        weighted=weighted)]
    assert reductions[0].dependence == divisor.SCALAR
    messages = []
    weight = divisor.micro_batch_weight(
        reductions, lambda: np.float32(12.0), messages.append,
        has_other_losses=False,
        mean_losses=[_scalar_loss] if found_a_mean else [])
    assert weight == 12.0  # the prediction's elements
    assert bool([m for m in messages if "one number" in m]) == warned


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


# A batch split inside the step (`micro_batch_size`) ------------------------


@pytest.mark.parametrize("batch_size", [0, 1, 5, 31, 32, 33, 100])
@pytest.mark.parametrize("size", [1, 4, 32])
def test_micro_batches_cover_the_batch_once_within_their_size(batch_size,
                                                              size):
    bounds = micro_step.micro_batch_bounds(batch_size, size)
    assert len(bounds) == micro_step.micro_batch_count(batch_size, size)
    rows = [row for start, stop in bounds for row in range(start, stop)]
    assert rows == list(range(batch_size))
    assert all(0 <= stop - start <= size for start, stop in bounds)
    # Only the last may be short (or an empty batch's one micro-batch).
    assert all(stop - start == size for start, stop in bounds[:-1])


def test_a_split_batch_is_one_micro_step_of_the_whole_batch():
    # A linear model's mean squared error: each micro-batch's gradient is
    # the mean of its samples', weighted by its samples; the first counts,
    # the others do not, and the window ends after the last.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(11, 3))
    y = rng.normal(size=(11,))
    weights = rng.normal(size=(3,))

    def gradient(rows):
        error = x[rows] @ weights - y[rows]
        return [2.0 * (x[rows].T @ error) / len(error)]

    config = window.WindowConfig(overwrite=(False,))
    whole = window.micro_batch_added(
        config, window.empty_state([(3,)], "float64", (False,), 2,
                                   NUMPY_OPS),
        gradient(np.arange(11)), 11.0, 1.0, 11.0, NUMPY_OPS)
    split = window.empty_state([(3,)], "float64", (False,), 2, NUMPY_OPS)
    for index, (start, stop) in enumerate(
            micro_step.micro_batch_bounds(11, 4)):
        split = window.micro_batch_added(
            config, split, gradient(np.arange(start, stop)),
            float(stop - start), 1.0, float(stop - start), NUMPY_OPS,
            counts=index == 0)
        assert split.micro_steps == 1 and not window.ends(split)
    np.testing.assert_allclose(
        window.mean_gradients(config, split, ["float64"], NUMPY_OPS),
        window.mean_gradients(config, whole, ["float64"], NUMPY_OPS))
    assert (split.weight_sum, split.sample_sum) == (11.0, 11.0)
    assert window.ends(window.micro_batch_added(
        config, split, gradient(np.arange(11)), 11.0, 1.0, 11.0, NUMPY_OPS))


def test_the_shares_of_a_split_batch_make_up_its_window():
    # Two batches a window, each split in three: each micro-batch is a
    # sixth of the window, on each of two replicas a twelfth.
    share = arithmetic.micro_batch_share(2, 0, -1, 2, NUMPY_OPS,
                                         micro_batches=3)
    assert share == pytest.approx(1 / 12)


def test_auto_bisects_to_the_largest_size_that_fits():
    tried = []

    def fits_24(size):
        tried.append(size)
        return size <= 24

    assert micro_step.micro_batch_candidates(100) == [
        1, 2, 4, 8, 16, 32, 64, 100]
    assert micro_step.largest_fitting(100, fits_24) == 16
    assert len(tried) <= 3
    assert micro_step.largest_fitting(100, lambda size: True) == 100
    assert micro_step.largest_fitting(100, lambda size: False) is None
    assert micro_step.largest_fitting(1, lambda size: True) == 1
