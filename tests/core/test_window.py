"""The window's transitions (`core.window`) on NumPy, against hand
computations: what moves when, weights and divisors, short and empty
micro-batches, overflow verdicts, noise estimates, pooled moments and the
file layout."""

import numpy as np
import pytest

from accum_model.core import arithmetic
from accum_model.core import checkpoint_layout as layout
from accum_model.core import window
from accum_model.core.numpy_ops import NUMPY_OPS as OPS
from accum_model.core.settings import Settings

SHAPES = [(3, 2), (2,)]


def _state(length=4, dtype="float32", overwrite=(False, False), **kwargs):
    return window.empty_state(SHAPES, dtype, overwrite, length, OPS,
                              **kwargs)


def _config(**kwargs):
    return window.WindowConfig(overwrite=(False, False), **kwargs)


def _gradients(seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype("float32") for shape in SHAPES]


def _add(state, seed, weight, loss=1.0, samples=None, config=None):
    return window.micro_batch_added(
        config or _config(), state, _gradients(seed), np.float32(weight),
        np.float32(loss), np.float32(weight if samples is None else samples),
        OPS)


def _mean(config, state):
    return window.mean_gradients(config, state, ["float32"] * len(SHAPES),
                                 OPS)


def _linear_gradient(w, x, y):
    """The gradient of mean((x @ w - y)^2) in w: a micro-batch's mean loss."""
    return 2.0 * x.T @ (x @ w - y) / len(x)


# What moves when -------------------------------------------------------------

def test_an_empty_window_holds_zeros_of_its_dtypes():
    state = _state(dtype="float64", overwrite=(True, False))
    assert [s.dtype.name for s in state.gradient_sums] == ["float32",
                                                           "float64"]
    assert [s.shape for s in state.gradient_sums] == SHAPES
    assert int(state.micro_steps) == 0 and int(state.length) == 4
    assert float(state.weight_sum) == 0.0


def test_a_window_ends_at_its_length_and_not_before():
    state = _state(length=3)
    endings = []
    for step in range(3):
        state = _add(state, step, 8.0)
        endings.append(bool(window.ends(state)))
    assert endings == [False, False, True]
    assert int(state.micro_steps) == 3


def test_the_end_of_an_epoch_ends_a_short_window():
    state = window.with_epoch(_state(length=4), 2, OPS)
    state = _add(state, 0, 8.0)
    assert not window.ends(state)
    state = _add(state, 1, 8.0)
    assert window.ends(state) and int(state.micro_steps) == 2


@pytest.mark.parametrize("length, epoch_steps", [(3, -1), (4, 2), (2, 5)])
def test_the_step_that_will_end_a_window_is_known_before_it_runs(
        length, epoch_steps):
    state = window.with_epoch(_state(length=length), epoch_steps, OPS)
    for step in range(length):
        predicted = bool(window.ends_with_next(state))
        state = _add(state, step, 8.0)
        assert predicted == bool(window.ends(state))
        if predicted:
            break


def test_unknown_epoch_length_never_ends_a_window_early():
    state = window.with_epoch(_state(length=2), -1, OPS)
    state = _add(state, 0, 8.0)
    assert not window.ends(state)
    assert int(state.steps_left_in_epoch) == -2


# The promise: weights and divisors -----------------------------------------

def test_micro_batches_weighted_by_size_give_the_large_batch_gradient():
    # A linear least-squares model: micro-batches of 5, 5 and a short 2.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3))
    y = rng.normal(size=(12, 2))
    w = rng.normal(size=(3, 2))
    config = window.WindowConfig(overwrite=(False,))
    state = window.empty_state([(3, 2)], "float64", (False,), 3, OPS)
    for start, stop in ((0, 5), (5, 10), (10, 12)):
        gradient = _linear_gradient(w, x[start:stop], y[start:stop])
        state = window.micro_batch_added(
            config, state, [gradient], np.float32(stop - start),
            np.float32(0.0), np.float32(stop - start), OPS)
    (mean,) = window.mean_gradients(config, state, ["float64"], OPS)
    np.testing.assert_allclose(mean, _linear_gradient(w, x, y), rtol=1e-6)


def test_equal_weights_would_not_be_the_large_batch():
    # The same micro-batches averaged with equal weight (Keras's own
    # gradient_accumulation_steps) miss the large batch by far more than
    # rounding: the test above could fail.
    rng = np.random.default_rng(0)
    x, y, w = (rng.normal(size=(12, 3)), rng.normal(size=(12, 2)),
               rng.normal(size=(3, 2)))
    equal = np.mean([_linear_gradient(w, x[a:b], y[a:b])
                     for a, b in ((0, 5), (5, 10), (10, 12))], axis=0)
    assert np.abs(equal - _linear_gradient(w, x, y)).max() > 1e-2


def test_a_sum_loss_window_is_the_sum_of_its_micro_batches():
    config = _config(divide_by_weight=False)
    state = _add(_add(_state(), 0, 1.0, config=config), 1, 1.0,
                 config=config)
    expected = [a + b for a, b in zip(_gradients(0), _gradients(1))]
    for got, want in zip(_mean(config, state), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_window_of_weight_zero_has_a_zero_gradient_and_loss():
    # Every element masked: Keras's divide_no_nan gives the large batch a
    # zero gradient and a zero loss; a micro-batch's own 0/0 loss adds 0.
    state = _add(_add(_state(), 0, 0.0, loss=np.nan), 1, 0.0, loss=np.nan)
    for mean in _mean(_config(), state):
        assert np.all(mean == 0.0)
    assert float(window.loss(_config(), state, OPS)) == 0.0


def test_the_window_loss_is_the_weighted_mean_of_its_micro_batches():
    state = _add(_add(_state(), 0, 2.0, loss=1.0), 1, 6.0, loss=3.0)
    assert float(window.loss(_config(), state, OPS)) == pytest.approx(2.5)
    summed = window.loss(_config(divide_by_weight=False),
                         _add(_add(_state(), 0, 1.0, loss=1.0), 1, 1.0,
                              loss=3.0), OPS)
    assert float(summed) == pytest.approx(4.0)


def test_variables_keras_overwrites_keep_the_largest_value():
    config = window.WindowConfig(overwrite=(True, False))
    state = _state(overwrite=(True, False))
    state = window.micro_batch_added(
        config, state,
        [np.full((3, 2), -5.0, "float32"), np.ones(2, "float32")],
        np.float32(4.0), np.float32(0.0), np.float32(4.0), OPS)
    # The first micro-batch's value is taken even below zero.
    assert np.all(state.gradient_sums[0] == -5.0)
    state = window.micro_batch_added(
        config, state,
        [np.full((3, 2), -7.0, "float32"), np.ones(2, "float32")],
        np.float32(4.0), np.float32(0.0), np.float32(4.0), OPS)
    assert np.all(state.gradient_sums[0] == -5.0)
    kept, summed = _mean(config, state)
    assert np.all(kept == -5.0) and np.allclose(summed, 1.0)


def test_a_variable_no_micro_batch_reached_gets_no_gradient():
    config = _config(has_gradient=(True, False))
    kept, missing = _mean(config, _add(_state(), 0, 3.0, config=config))
    assert missing is None and kept is not None


def test_float64_accumulators_sum_in_float64():
    state = _state(dtype="float64")
    tiny = [np.full(shape, 1e-9, "float32") for shape in SHAPES]
    big = [np.full(shape, 1.0, "float32") for shape in SHAPES]
    for gradients in (big, tiny):
        state = window.micro_batch_added(
            _config(), state, gradients, np.float32(1.0), np.float32(0.0),
            np.float32(1.0), OPS)
    assert state.gradient_sums[0].dtype == np.float64
    # 1 + 1e-9 is 1 in float32.
    assert state.gradient_sums[0][0, 0] > 1.0


def test_narrow_accumulators_round_each_product():
    state = _state(dtype="float16")
    state = _add(state, 0, 3.0)
    assert state.gradient_sums[1].dtype == np.float16
    np.testing.assert_array_equal(
        state.gradient_sums[1],
        (_gradients(0)[1] * np.float32(3.0)).astype("float16"))


# Reset, skip, lengths and epochs --------------------------------------------

def test_a_reset_empties_the_window_and_keeps_the_epochs_counts():
    config = _config(measure_noise_scale=True)
    state = window.with_length(_state(length=2), 3, OPS)
    state = _add(_add(state, 0, 4.0, config=config), 1, 2.0, config=config)
    state = window.ended(config, state, OPS).next_state
    state = state._replace(skipped_windows=np.int32(2))
    emptied = window.reset(state, OPS)
    assert all(np.all(s == 0) for s in emptied.gradient_sums)
    assert int(emptied.micro_steps) == 0 and float(emptied.weight_sum) == 0
    assert int(emptied.length) == 3          # the next window's length
    assert int(emptied.skipped_windows) == 2
    assert float(emptied.noise_estimates) == 1.0
    assert float(emptied.noise_weight_sum) == 0.0


# The window's end ----------------------------------------------------------

@pytest.mark.parametrize("verdict", [True, False, np.bool_(True),
                                     np.bool_(False)])
def test_a_window_end_applies_and_measures_or_skips_and_counts(verdict):
    config = _config(measure_noise_scale=True)
    state = _add(_add(_state(), 0, 4.0, loss=2.0, config=config), 1, 2.0,
                 loss=5.0, config=config)
    end = window.ended(config, state, OPS, verdict)
    applied = bool(verdict)
    assert bool(end.applies) == applied and bool(end.skips) == (not applied)
    # Known while tracing where the verdict is.
    assert isinstance(end.applies, bool) == isinstance(verdict, bool)
    assert end.reports is True
    next_state = end.next_state
    assert int(next_state.skipped_windows) == (0 if applied else 1)
    assert float(next_state.noise_estimates) == (1.0 if applied else 0.0)
    assert int(next_state.micro_steps) == 0
    assert float(next_state.weight_sum) == 0.0
    assert all(np.all(s == 0) for s in next_state.gradient_sums)


def test_a_window_without_checks_always_applies_and_traces_no_condition():
    end = window.ended(_config(), _add(_state(), 0, 1.0), OPS)
    assert (end.applies, end.skips, end.reports) == (True, False, True)


@pytest.mark.parametrize("verdict", [True, np.bool_(False)])
def test_a_window_of_empty_steps_alone_is_emptied_and_nothing_else(verdict):
    # Across replicas a window may hold only steps on empty batches (data
    # of unknown length ran out on every replica): no update, no skip, no
    # loss logged, no statistics moved, not measured.
    config = _config(measure_noise_scale=True)
    state = _add(_add(_state(), 0, 0.0, config=config), 1, 0.0,
                 config=config)
    end = window.ended(config, state, OPS, verdict,
                       has_samples=np.bool_(False))
    assert not bool(end.applies) and not bool(end.skips)
    assert not bool(end.reports)
    assert int(end.next_state.skipped_windows) == 0
    assert float(end.next_state.noise_estimates) == 0.0
    assert int(end.next_state.micro_steps) == 0


def test_a_skipped_window_reports_so_statistics_move_as_the_large_batchs():
    # The large batch's forward pass moves BatchNormalization's statistics
    # even where its update is skipped for overflow: the window's end
    # reports its pooled moments on a skip too, then empties them.
    sums = [np.asarray([[2.0, 2.0], [1.0, 3.0], [1.0, 5.0]], "float32")]
    state = _add(_state(statistics_sums=sums), 0, 2.0)
    end = window.ended(_config(), state, OPS, np.bool_(False))
    assert bool(end.reports) and bool(end.skips)
    assert int(end.next_state.skipped_windows) == 1
    assert all(np.all(s == 0) for s in end.next_state.statistics_sums)


def test_the_float16_verdict_skips_a_window_whose_large_batch_overflows():
    # Finite float32 sums whose large batch, scaled, leaves float16's range:
    # the window's checks under loss scaling fail it and its end skips it.
    config = _config(float16=(True, False))
    state = _add(_state(), 0, 1.0)
    state = state._replace(gradient_sums=[
        np.full(SHAPES[0], 40000.0, "float32"),
        np.zeros(SHAPES[1], "float32")])
    checks = window.end_checks(loss_scaled=True, settings=Settings())
    verdict = window.passes(checks, config, state, np.float32(2.0), OPS)
    assert bool(window.is_finite(state, OPS)) and not bool(verdict)
    end = window.ended(config, state, OPS, verdict)
    assert bool(end.skips) and int(end.next_state.skipped_windows) == 1


@pytest.mark.parametrize("steps_left", [1, -1])
def test_an_epochs_end_ends_a_short_window_that_then_applies(steps_left):
    state = window.with_epoch(_state(length=4), steps_left, OPS)
    state = _add(state, 0, 2.0)
    assert bool(window.ends(state)) == (steps_left == 1)
    end = window.ended(_config(), state, OPS)
    assert end.applies is True
    assert int(end.next_state.length) == 4
    assert int(end.next_state.steps_left_in_epoch) == steps_left - 1


def test_estimates_summed_by_the_store_are_the_ones_counted():
    config = _config(measure_noise_scale=True)
    state = _add(_add(_state(), 0, 4.0, config=config), 1, 2.0,
                 config=config)
    summed = [np.float32(3.0), np.float32(5.0), np.float32(2.0)]
    end = window.ended(config, state, OPS, estimates=summed)
    assert float(end.next_state.noise_trace_sum) == 3.0
    assert float(end.next_state.noise_estimates) == 2.0


def test_an_open_window_keeps_its_length_until_its_end():
    state = _add(_state(length=4), 0, 1.0)
    state = window.with_length(state, 2, OPS)
    assert int(state.length) == 4 and int(state.next_length) == 2
    assert int(window.reset(state, OPS).length) == 2
    assert int(window.with_length(_state(length=4), 2, OPS).length) == 2


def test_a_new_epoch_forgets_the_last_epochs_noise_estimates():
    state = _state()._replace(noise_trace_sum=np.float32(3.0),
                              noise_estimates=np.float32(1.0))
    assert float(window.with_epoch(state, 5, OPS).noise_estimates) == 0.0
    kept = window.with_epoch(state, 5, OPS, new_epoch=False)
    assert float(kept.noise_estimates) == 1.0
    assert int(kept.steps_left_in_epoch) == 5


# Overflow verdicts ----------------------------------------------------------

def test_a_non_finite_sum_is_seen():
    state = _add(_state(), 0, 1.0)
    assert window.is_finite(state, OPS)
    broken = state._replace(gradient_sums=[
        state.gradient_sums[0], np.array([1.0, np.inf], "float32")])
    assert not window.is_finite(broken, OPS)


@pytest.mark.parametrize("largest, fits", [(1000.0, True), (70000.0, False)])
def test_the_float16_verdict_is_the_large_batchs(largest, fits):
    # The large batch's float16 gradient: the sum times the scale over the
    # window's weight, against float16's largest value rounded up.
    config = _config(float16=(False, True))
    state = _state()._replace(
        gradient_sums=[np.zeros((3, 2), "float32"),
                       np.array([largest * 8.0, 1.0], "float32")],
        weight_sum=np.float32(8.0))
    assert bool(window.fits_float16(config, state, np.float32(1.0),
                                    OPS)) is fits
    # Only the flagged variables count, and not one Keras overwrites.
    assert window.fits_float16(_config(), state, np.float32(1.0), OPS)
    kept = window.WindowConfig(overwrite=(False, True), float16=(False, True))
    assert window.fits_float16(kept, state, np.float32(1.0), OPS)


def _overflowing_states():
    """A window in range, one with an infinite sum, and one whose float16
    large batch would overflow at a scale of 1 (sum 70000 * 8 over 8)."""
    state = _state()._replace(
        gradient_sums=[np.zeros((3, 2), "float32"),
                       np.array([8.0, 1.0], "float32")],
        weight_sum=np.float32(8.0))
    infinite = state._replace(gradient_sums=[
        state.gradient_sums[0], np.array([np.inf, 1.0], "float32")])
    too_large = state._replace(gradient_sums=[
        state.gradient_sums[0], np.array([70000.0 * 8.0, 1.0], "float32")])
    return state, infinite, too_large


@pytest.mark.parametrize("loss_scaled, narrow, verdicts", [
    # Under loss scaling both checks, as Keras's LossScaleOptimizer checks
    # one large batch; narrow accumulators check finiteness; else none.
    (True, False, (True, False, False)),
    (True, True, (True, False, False)),
    (False, True, (True, False, True)),
    (False, False, (True, True, True)),
])
def test_the_end_checks_judge_a_window_as_the_large_batch(
        loss_scaled, narrow, verdicts):
    config = _config(float16=(False, True))
    checks = window.end_checks(loss_scaled, Settings(
        accumulator_dtype="bfloat16" if narrow else "float32"))
    scale = np.float32(1.0) if loss_scaled else None
    assert tuple(bool(window.passes(checks, config, state, scale, OPS))
                 for state in _overflowing_states()) == verdicts


def test_a_check_of_ones_own_joins_the_verdict():
    # A window verdict is a function of the summed window: one that skips
    # windows whose gradient is larger than a bound (as optax's
    # `skip_large_updates`) needs nothing else.
    def small(config, state, loss_scale, ops):
        del config, loss_scale
        return ops.all(ops.abs(state.gradient_sums[1]) < 100.0)

    config = _config(float16=(False, True))
    in_range, _, too_large = _overflowing_states()
    checks = window.end_checks(False, Settings()) + (small,)
    assert bool(window.passes(checks, config, in_range, None, OPS))
    assert not bool(window.passes(checks, config, too_large, None, OPS))


# The noise scale --------------------------------------------------------------

def test_noise_estimates_are_the_hand_computed_ones():
    # McCandlish et al.: with micro-batch mean gradients g_v of weights v,
    # A = sum v |g_v|^2, W = sum v, S = |sum v g_v|^2 / W: tr(Sigma) =
    # (A - S) / (m - 1) and |G|^2 = (S - A/m) m / (W (m - 1)).
    config = _config(measure_noise_scale=True)
    weights = [2.0, 3.0, 5.0]
    state = _state(length=3)
    for seed, weight in enumerate(weights):
        state = _add(state, seed, weight, config=config)
    state = window.ended(config, state, OPS).next_state
    flat = [np.concatenate([g.ravel() for g in _gradients(seed)]).astype(
        "float64") for seed in range(3)]
    a = sum(v * (g @ g) for v, g in zip(weights, flat))
    total = sum(v * g for v, g in zip(weights, flat))
    w, m = sum(weights), 3.0
    s = (total @ total) / w
    np.testing.assert_allclose(float(state.noise_trace_sum),
                               (a - s) / (m - 1), rtol=1e-5)
    np.testing.assert_allclose(float(state.noise_signal_sum),
                               (s - a / m) * m / (w * (m - 1)), rtol=1e-5)
    assert float(state.noise_estimates) == 1.0


@pytest.mark.parametrize("case", ["skipped", "one_micro_batch",
                                  "restored_open", "not_measured"])
def test_windows_that_say_nothing_of_the_noise_are_not_counted(case):
    config = _config(measure_noise_scale=case != "not_measured")
    state = _state()
    if case == "restored_open":
        state = state._replace(noise_measurable=np.float32(0.0))
    for seed in range(1 if case == "one_micro_batch" else 2):
        state = _add(state, seed, 4.0, config=config)
    state = window.ended(config, state, OPS,
                         verdict=case != "skipped").next_state
    assert float(state.noise_estimates) == 0.0


# Pooled moments of normalization layers ---------------------------------

def test_pooled_moments_move_statistics_as_the_large_batch():
    # Micro-batches of 3, 5 and 2 elements; the layer's own update from the
    # large batch's mean and biased variance, shifted by the moving mean.
    rng = np.random.default_rng(1)
    data = rng.normal(3.0, 2.0, size=(10, 4)).astype("float64")
    shift = np.full(4, 2.5)
    sums = np.zeros((3, 4))
    for start, stop in ((0, 3), (3, 8), (8, 10)):
        part = data[start:stop]
        sums += np.stack(arithmetic.statistics_terms(
            np.full(4, float(len(part))), part.mean(0), part.var(0), shift,
            OPS))
    moving_mean, moving_variance = arithmetic.pooled_moving_statistics(
        sums[0], sums[1], sums[2], shift, shift, np.ones(4), 0.9, OPS)
    np.testing.assert_allclose(moving_mean, 0.9 * shift + 0.1 * data.mean(0),
                               rtol=1e-12)
    np.testing.assert_allclose(moving_variance, 0.9 + 0.1 * data.var(0),
                               rtol=1e-12)



@pytest.mark.parametrize("sizes", [(3, 5, 2), (4, 0)])
def test_moments_of_parts_are_the_whole_batchs(sizes):
    # Each device's part as a row; the collective sums over the rows. A
    # part with no elements has Keras's moments of nothing, 0 and 0.
    rng = np.random.default_rng(2)
    data = rng.normal(40.0, 3.0, size=(sum(sizes), 4)).astype("float32")
    bounds = np.cumsum((0,) + sizes)
    parts = [data[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    count = np.array([[len(part)] * 4 for part in parts], "float32")
    mean = np.stack([part.mean(0) if len(part) else np.zeros(4, "float32")
                     for part in parts])
    variance = np.stack([part.var(0) if len(part) else np.zeros(4, "float32")
                         for part in parts])

    def summed(values):
        if isinstance(values, tuple):
            return tuple(summed(value) for value in values)
        return np.broadcast_to(values.sum(0), values.shape)

    total, whole_mean, whole_variance = arithmetic.moments_of_parts(
        count, mean, variance, summed, OPS)
    for row in range(len(sizes)):
        assert np.all(total[row] == len(data))
        np.testing.assert_allclose(whole_mean[row], data.mean(0), rtol=1e-6)
        np.testing.assert_allclose(whole_variance[row],
                                   data.astype("float64").var(0), rtol=1e-4)


def test_moments_of_parts_without_elements_are_zero():
    zeros = np.zeros((2, 3), "float32")
    total, mean, variance = arithmetic.moments_of_parts(
        zeros, zeros, zeros, lambda v: (tuple(x.sum(0) + 0 * x for x in v)
                                        if isinstance(v, tuple)
                                        else v.sum(0) + 0 * v), OPS)
    assert np.all(total == 0) and np.all(mean == 0) and np.all(variance == 0)

# The file layout ---------------------------------------------------------------

def test_an_open_window_round_trips_through_the_file_layout():
    state = _add(_add(_state(), 0, 3.0), 1, 5.0)
    counters = {name: float(getattr(state, name)) for name in layout.COUNTERS}
    saved = layout.saved_state(state.gradient_sums, [True, True], counters)
    arrays = layout.read(saved)
    gradients, has_gradient, restored = layout.window_to_write(
        arrays, [6, 2], 0.0)
    for got, want in zip(gradients, state.gradient_sums):
        np.testing.assert_array_equal(got, want.ravel())
    assert has_gradient == [True, True] and restored == counters


def test_a_file_for_other_weights_is_refused():
    saved = layout.saved_state([np.zeros(3, "float32")], [True],
                               {name: 0.0 for name in layout.COUNTERS})
    with pytest.raises(ValueError, match="sizes"):
        layout.window_to_write(layout.read(saved), [6, 2], 0.0)


def _statistics_file(entries, names, version=None):
    counters = {name: 0.0 for name in layout.COUNTERS}
    counters["micro_steps"] = 1.0
    saved = layout.saved_state([np.zeros(2, "float32")], [True], counters,
                               entries, names)
    if version is not None:
        saved["counters"] = saved["counters"][:len(layout.COUNTERS)]
    arrays = layout.read(saved)
    return arrays, layout.window_to_write(arrays, [2], 0.0)[2]


def test_statistics_are_filed_by_layer_name_and_read_into_any_order():
    # TensorFlow holds them in call order, JAX and PyTorch in layer order:
    # the file is the same, and each reads its own order back.
    a, b1, b2 = (np.full([3, width], float(width), "float32")
                 for width in (1, 2, 3))
    arrays, counters = _statistics_file([b1, a, b2], ["b", "a", "b"])
    np.testing.assert_array_equal(
        arrays["statistics"],
        np.concatenate([a.ravel(), b1.ravel(), b2.ravel()]))
    read = layout.statistics_to_write(
        arrays, [(3, 2), (3, 3), (3, 1)], counters, ["b", "b", "a"])
    for got, want in zip(read, [b1, b2, a]):
        np.testing.assert_array_equal(got, want)


def test_statistics_without_a_name_each_are_refused():
    counters = {name: 0.0 for name in layout.COUNTERS}
    with pytest.raises(ValueError, match="statistics_names"):
        layout.saved_state([np.zeros(2, "float32")], [True], counters,
                           [np.zeros([3, 2], "float32")], [])


def test_statistics_of_a_file_without_the_layout_version_keep_its_order():
    # Files written before the statistics were filed by name hold them in
    # the order of the store that wrote them.
    first, second = (np.full([3, 2], value, "float32") for value in (1, 2))
    arrays, counters = _statistics_file([first, second], ["a", "b"],
                                        version=0)
    read = layout.statistics_to_write(arrays, [(3, 2), (3, 2)], counters,
                                      ["b", "a"])
    np.testing.assert_array_equal(read[0], first)
    np.testing.assert_array_equal(read[1], second)


# What a store of per-replica variables asks of the transitions -----------------

def test_a_step_that_does_not_count_moves_no_counter():
    state = _state(length=2, steps_left_in_epoch=5)
    after = window.micro_batch_added(
        _config(), state, _gradients(0), np.float32(0.0), np.float32(0.0),
        np.float32(0.0), OPS, counts=np.bool_(False))
    assert int(after.micro_steps) == 0
    assert int(after.steps_left_in_epoch) == 5
    counted = window.micro_batch_added(
        _config(), state, _gradients(0), np.float32(2.0), np.float32(1.0),
        np.float32(2.0), OPS, counts=np.bool_(True))
    assert int(counted.micro_steps) == 1
    assert int(counted.steps_left_in_epoch) == 4


def test_a_missing_gradient_or_loss_leaves_its_sum_as_it_was():
    state = _add(_state(), 1, weight=2.0, loss=3.0)
    gradients = _gradients(2)
    after = window.micro_batch_added(
        _config(), state, [None, gradients[1]], np.float32(1.0), None,
        np.float32(1.0), OPS)
    np.testing.assert_array_equal(after.gradient_sums[0],
                                  state.gradient_sums[0])
    np.testing.assert_allclose(after.gradient_sums[1],
                               state.gradient_sums[1] + gradients[1])
    assert float(after.loss_sum) == float(state.loss_sum) == 6.0
    assert float(after.weight_sum) == 3.0


def test_an_emptied_window_may_keep_its_last_sums_and_they_never_count():
    # A store may leave the last window's sums in an emptied window (JAX's
    # compiled step does): the next window's first micro-batch writes over
    # them, a missing gradient and a variable Keras overwrites included,
    # and a file holds zeros.
    config = window.WindowConfig(overwrite=(True, False))
    full = _add(_add(_state(length=2), 0, 4.0, config=config), 1, 2.0,
                config=config)
    left = window.reset(full, OPS)._replace(gradient_sums=full.gradient_sums)
    assert all(np.all(s == 0)
               for s in window.counted_gradient_sums(left, OPS))
    gradients = _gradients(2)
    after = window.micro_batch_added(
        config, left, gradients, np.float32(3.0), np.float32(1.0),
        np.float32(3.0), OPS)
    fresh = window.micro_batch_added(
        config, window.reset(full, OPS), gradients, np.float32(3.0),
        np.float32(1.0), np.float32(3.0), OPS)
    for got, want in zip(after.gradient_sums, fresh.gradient_sums):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(after.gradient_sums[1], gradients[1] * 3)
    missing = window.micro_batch_added(
        config, left, [None, None], np.float32(1.0), np.float32(1.0),
        np.float32(1.0), OPS)
    assert all(np.all(s == 0) for s in missing.gradient_sums)
    for got, want in zip(window.counted_gradient_sums(after, OPS),
                         after.gradient_sums):
        np.testing.assert_array_equal(got, want)


def test_counters_added_is_added_without_the_gradient_sums():
    config = _config(measure_noise_scale=True)
    state = _add(_state(), 1, weight=2.0, config=config)
    whole = _add(state, 2, weight=3.0, config=config)
    counters = window.counters_added(
        config, state, _gradients(2), np.float32(3.0), np.float32(1.0),
        np.float32(3.0), OPS)
    assert counters.gradient_sums is state.gradient_sums
    for field in window.WindowState._fields:
        if field not in ("gradient_sums", "statistics_sums"):
            np.testing.assert_array_equal(getattr(counters, field),
                                          getattr(whole, field))


def test_float64_sums_are_weighted_and_divided_in_float64():
    config = _config()
    state = _state(dtype="float64")
    gradient = [np.full(shape, 1.0 / 3.0, np.float32) for shape in SHAPES]
    weight = np.float32(3.0)
    state = window.micro_batch_added(
        config, state, gradient, weight, np.float32(0.0), weight, OPS)
    assert state.gradient_sums[0].dtype == np.float64
    mean = window.mean_gradients(config, state, ["float64"] * 2, OPS)
    np.testing.assert_array_equal(mean[0], np.float64(np.float32(1 / 3)))


def test_a_backends_own_squared_norm_counts_in_the_noise_sums():
    config = _config(measure_noise_scale=True)
    doubled = OPS._replace(
        squared_norm=lambda a: 2.0 * np.sum(np.square(a)).astype("float32"))
    gradients = _gradients(3)
    plain = window.micro_batch_added(
        config, _state(), gradients, np.float32(1.0), np.float32(0.0),
        np.float32(1.0), OPS)
    own = window.micro_batch_added(
        config, _state(), gradients, np.float32(1.0), np.float32(0.0),
        np.float32(1.0), doubled)
    assert float(own.noise_squared_norm_sum) == pytest.approx(
        2.0 * float(plain.noise_squared_norm_sum))


def test_estimates_summed_over_replicas_count_once_per_applied_window():
    config = _config(measure_noise_scale=True)
    replicas = []
    for seed in (4, 5):
        state = _state()
        for step in range(3):
            state = _add(state, seed * 10 + step, weight=2.0, config=config)
        replicas.append(window.window_estimates(config, state, OPS))
    summed = [a + b for a, b in zip(*replicas)]
    assert float(summed[2]) == 2.0
    counted = window.with_estimates(_state(), summed, OPS)
    assert float(counted.noise_estimates) == 2.0
    assert float(counted.noise_trace_sum) == pytest.approx(
        float(replicas[0][0] + replicas[1][0]))
    skipped = window.with_estimates(_state(), summed, OPS,
                                    applied=np.bool_(False))
    assert float(skipped.noise_estimates) == 0.0


def test_a_window_of_one_micro_batch_or_restored_open_is_not_measured():
    config = _config(measure_noise_scale=True)
    one = _add(_state(), 6, weight=2.0, config=config)
    assert [float(v) for v in window.window_estimates(config, one, OPS)] == [
        0.0, 0.0, 0.0]
    two = _add(one, 7, weight=2.0, config=config)
    restored = two._replace(noise_measurable=np.float32(0.0))
    assert float(window.window_estimates(config, two, OPS)[2]) == 1.0
    assert float(window.window_estimates(config, restored, OPS)[2]) == 0.0


def test_counters_keep_the_stores_integer_dtype():
    state = _state()._replace(micro_steps=np.int64(0),
                              length=np.int64(4), next_length=np.int64(4),
                              steps_left_in_epoch=np.int64(-1),
                              skipped_windows=np.int64(0))
    state = window.with_length(state, 2, OPS)
    state = window.with_epoch(state, 7, OPS)
    state = window.ended(_config(), state, OPS, np.bool_(False)).next_state
    assert {np.asarray(getattr(state, name)).dtype.name for name in (
        "length", "next_length", "steps_left_in_epoch",
        "skipped_windows")} == {"int64"}


def test_a_restored_window_takes_its_counters_and_is_measured_only_if_empty():
    config = _config(measure_noise_scale=True)
    state = _add(_add(_state(), 1, 2.0, config=config), 2, 2.0,
                 config=config)
    counters = {"weight_sum": 5.0, "sample_sum": 5.0, "micro_steps": 3.0,
                "skipped_windows": 1.0, "length": 4.0, "loss_sum": 2.5}
    open_window = window.restored(state, counters, OPS)
    assert int(open_window.micro_steps) == 3
    assert open_window.micro_steps.dtype == state.micro_steps.dtype
    assert float(open_window.weight_sum) == 5.0
    assert float(open_window.noise_squared_norm_sum) == 0.0
    assert float(window.window_estimates(config, _add(
        _add(open_window, 3, 2.0, config=config), 4, 2.0,
        config=config), OPS)[2]) == 0.0
    empty = window.restored(state, dict(counters, micro_steps=0.0), OPS)
    assert float(empty.noise_measurable) == 1.0


def test_a_backends_list_division_gives_the_same_mean_gradients():
    # `divide_all_no_nan` divides every float32 sum at once; the mean is the
    # per-array division's, a weight of zero included, and a variable
    # Keras overwrites or no micro-batch reached is left to the rule.
    calls = []

    def divide_all_no_nan(arrays, denominator):
        calls.append(len(arrays))
        return [arithmetic.divide_no_nan(a, denominator, OPS) for a in arrays]

    listing = OPS._replace(divide_all_no_nan=divide_all_no_nan)
    for weight in (3.0, 0.0):
        state = _add(_state(), 0, weight)
        for config in (_config(), _config(has_gradient=(True, False)),
                       window.WindowConfig(overwrite=(True, False))):
            expected = window.mean_gradients(config, state,
                                             ["float32"] * 2, OPS)
            listed = window.mean_gradients(config, state, ["float32"] * 2,
                                           listing)
            for a, b in zip(expected, listed):
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_array_equal(a, b)
    assert calls == [2, 1, 1] * 2


def test_a_reset_takes_the_stores_zero_sums_where_given():
    state = _add(_state(), 0, 2.0)
    zeros = [np.zeros(shape, "float32") for shape in SHAPES]
    emptied = window.reset(state, OPS, zeros)
    assert all(a is b for a, b in zip(emptied.gradient_sums, zeros))
    assert int(emptied.micro_steps) == 0
    skipped = window.ended(_config(), state, OPS, np.bool_(False),
                           zero_sums=zeros).next_state
    assert all(a is b for a, b in zip(skipped.gradient_sums, zeros))
    assert int(skipped.skipped_windows) == 1


@pytest.mark.parametrize("divide_by_weight, share", [(True, 1 / 8),
                                                     (False, 1.0)])
def test_a_summed_loss_keeps_the_whole_loss_scale(divide_by_weight, share):
    # A mean's per-sample terms in a micro-batch of a window of 4 on 2
    # replicas are 8 times the large batch's; a sum's are the large batch's.
    assert arithmetic.micro_batch_share(
        np.int32(4), np.int32(0), np.int32(-1), 2, OPS,
        divide_by_weight) == pytest.approx(share)
