"""keras-hub tasks, built from small configs (no download), accumulate exactly.

Each task is used both ways a user would: as a mixin base
(`class X(AccumulatingModel, Task)`) and through `accumulating(task)`.
"""

import json
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import accumulating
from backends import jax_only
from helpers import iterations
from helpers import max_weight_difference

keras_hub = pytest.importorskip("keras_hub")

SEQUENCE = 12


def _causal_lm_backbone():
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=SEQUENCE, dropout=0.0,
    )


def _classifier_backbone():
    return keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=SEQUENCE, dropout=0.0,
    )


class AccumulatingGPT2(AccumulatingModel, keras_hub.models.GPT2CausalLM):
    pass


class AccumulatingBertClassifier(AccumulatingModel,
                                 keras_hub.models.BertTextClassifier):
    pass


def _causal_lm(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    return model_class(backbone=_causal_lm_backbone(), preprocessor=None,
                       **kwargs)


def _classifier(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    return model_class(backbone=_classifier_backbone(), num_classes=3,
                       preprocessor=None, dropout=0.0, **kwargs)


def _causal_lm_data(samples=32):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, size=(samples, SEQUENCE + 1)).astype("int32")
    padding = np.ones((samples, SEQUENCE + 1), bool)
    padding[::3, 8:] = False  # every third sequence is short
    x = {"token_ids": tokens[:, :-1], "padding_mask": padding[:, :-1]}
    return x, tokens[:, 1:], padding[:, 1:].astype("float32")


def _classifier_data(samples=32):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 50, size=(samples, SEQUENCE)).astype("int32")
    padding = np.ones((samples, SEQUENCE), bool)
    padding[::2, 6:] = False
    x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens),
         "padding_mask": padding}
    return x, (tokens[:, 0] % 3).astype("int32"), None


TASKS = {
    "causal_lm": (_causal_lm, keras_hub.models.GPT2CausalLM,
                  AccumulatingGPT2, _causal_lm_data),
    "classifier": (_classifier, keras_hub.models.BertTextClassifier,
                   AccumulatingBertClassifier, _classifier_data),
}


def _compile(model):
    # Plain SGD: Keras's Adam treats repeated rows of a sparse embedding
    # gradient one at a time, so its large batch is not the reference there
    # (docs/exactness.md; exactness with Adam is tested on dense models).
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )


def _fit(model, data, batch_size):
    x, y, sample_weight = data
    model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size,
              epochs=1, shuffle=False, verbose=0)


def _large_batch(task):
    make, plain_class, _, make_data = TASKS[task]
    plain = make(plain_class)
    _compile(plain)
    _fit(plain, make_data(), 32)
    return plain


# Every pair of a task, a way to make it accumulate and a replica count
# meets in some case: four cases rather than all eight.
@pytest.mark.parametrize("task, use, replicas", [
    ("causal_lm", "mixin", 1), ("causal_lm", "accumulating", 2),
    ("classifier", "mixin", 2), ("classifier", "accumulating", 1)])
def test_task_matches_the_large_batch(task, use, replicas, two_replicas):
    make, plain_class, mixin_class, make_data = TASKS[task]
    plain = _large_batch(task)
    strategy = two_replicas if replicas == 2 else None
    with strategy.scope() if strategy else _no_scope():
        if use == "mixin":
            model = make(mixin_class, n_gradients=4)
        else:
            model = accumulating(make(plain_class), n_gradients=4)
        _compile(model)
    assert isinstance(model, plain_class)
    _fit(model, make_data(), 8)
    assert iterations(model) == iterations(plain) == 1
    assert max_weight_difference(plain, model) <= 1e-5


@pytest.mark.parametrize("task", sorted(TASKS))
def test_task_under_mixed_float16(task):
    if keras.backend.backend() == "jax":
        import jax

        if jax.default_backend() == "cpu":
            pytest.skip("JAX on a CPU has no float16 matrix product (plain "
                        "Keras's task fails alike)")
    make, plain_class, mixin_class, make_data = TASKS[task]
    float32_plain = _large_batch(task)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = _large_batch(task)
        model = make(mixin_class, n_gradients=4)
        _compile(model)
        _fit(model, make_data(), 8)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.skipped_windows == 0
    rounding = max_weight_difference(plain, float32_plain)
    assert max_weight_difference(plain, model) <= 2 * rounding + 1e-6


def test_lora_fine_tune_trains_only_its_weights_like_the_large_batch():
    # keras-hub's LoRA leaves trainable only the LoRA factors and the
    # biases of the layers it adapts: the window holds accumulators for
    # those alone, moves them as the large batch, and leaves the rest.
    plain = _causal_lm(keras_hub.models.GPT2CausalLM)
    plain.backbone.enable_lora(rank=2)
    model = accumulating(_causal_lm(keras_hub.models.GPT2CausalLM),
                         n_gradients=4)
    model.backbone.enable_lora(rank=2)
    model.set_weights(plain.get_weights())
    frozen = [np.array(v) for v in model.non_trainable_variables]
    for each in (plain, model):
        _compile(each)
    _fit(plain, _causal_lm_data(), 32)
    _fit(model, _causal_lm_data(), 8)
    trainable = model.trainable_variables
    assert [v.path for v in trainable] == [
        v.path for v in plain.trainable_variables]
    assert any("lora" in v.path for v in trainable)
    assert model.accumulator_bytes == sum(
        4 * int(np.prod(v.shape)) for v in trainable)
    assert model.accumulator_bytes < sum(
        4 * int(np.prod(v.shape)) for v in model.weights) / 4
    assert iterations(model) == iterations(plain) == 1
    assert max_weight_difference(plain, model) <= 1e-5
    assert all(np.array_equal(a, np.array(b))
               for a, b in zip(frozen, model.non_trainable_variables))


def test_causal_lm_under_mixed_bfloat16_sums_in_float32():
    # bfloat16 compute, float32 weights and accumulators: the window lands
    # as near the large batch under the same policy as bfloat16 rounding
    # puts that large batch from float32's.
    float32_plain = _large_batch("causal_lm")
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        plain = _large_batch("causal_lm")
        model = accumulating(_causal_lm(keras_hub.models.GPT2CausalLM),
                             n_gradients=4)
        _compile(model)
        _fit(model, _causal_lm_data(), 8)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.compute_dtype == "bfloat16"
    assert model.accumulator_bytes == sum(
        4 * int(np.prod(v.shape)) for v in model.trainable_variables)
    assert iterations(model) == iterations(plain) == 1
    rounding = max_weight_difference(plain, float32_plain)
    assert rounding > 1e-6  # bfloat16 did round
    assert max_weight_difference(plain, model) <= 2 * rounding


def test_a_plain_task_built_before_an_accumulating_one_still_trains():
    # keras-hub's PipelineModel resets its bases as each task is built,
    # removing the Functional that Keras gave the plain task's classes.
    plain = _causal_lm(keras_hub.models.GPT2CausalLM)
    _causal_lm(AccumulatingGPT2, n_gradients=2)
    _compile(plain)
    _fit(plain, _causal_lm_data(samples=8), 8)
    assert iterations(plain) == 1


class _no_scope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@keras.saving.register_keras_serializable(package="accum_model_tests")
class SavedGPT2(AccumulatingModel, keras_hub.models.GPT2CausalLM):
    """A user's accumulating task, registered so that Keras can load it."""

    def __init__(self, *args, n_gradients=2, **kwargs):
        super().__init__(*args, n_gradients=n_gradients, **kwargs)


def _round_trip(model, how, path):
    if how == "keras_file":
        model.save(path / "task.keras")
        return keras.models.load_model(path / "task.keras")
    model.save_to_preset(str(path / "preset"))
    return SavedGPT2.from_preset(str(path / "preset"))


@pytest.mark.parametrize("round_trip", ["keras_file", "preset"])
def test_accumulating_task_saves_and_loads(round_trip, tmp_path):
    # keras-hub's `Task.from_config(cls, config)` takes no custom_objects.
    x, y, weights = _causal_lm_data(samples=8)
    model = _causal_lm(SavedGPT2, n_gradients=4, flush_each_epoch=False)
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    model.fit(x, y, sample_weight=weights, batch_size=2, epochs=1, verbose=0)
    loaded = _round_trip(model, round_trip, tmp_path)
    # The task is functional: its class is SavedGPT2's functional variant.
    assert isinstance(loaded, SavedGPT2)
    assert type(loaded).__name__ == "SavedGPT2"
    assert (loaded.n_gradients, loaded.flush_each_epoch) == (4, False)
    assert max_weight_difference(model, loaded) == 0.0
    # Training goes on like plain Keras's large batch from the loaded
    # weights. Compiled again: a preset holds no optimizer, and keras-hub
    # compiles a task loaded from a .keras file with its default optimizer
    # (Adam, for plain tasks too) whatever it was saved with.
    reference = _causal_lm(keras_hub.models.GPT2CausalLM)
    reference.set_weights(loaded.get_weights())
    for each in (loaded, reference):
        each.compile(optimizer="sgd",
                     loss=keras.losses.SparseCategoricalCrossentropy(
                         from_logits=True))
    loaded.fit(x, y, sample_weight=weights, batch_size=2, epochs=1,
               shuffle=False, verbose=0)
    reference.fit(x, y, sample_weight=weights, batch_size=8, epochs=1,
                  shuffle=False, verbose=0)
    assert max_weight_difference(loaded, reference) <= 1e-6
    assert max_weight_difference(loaded, model) > 1e-4  # it trained


@pytest.mark.parametrize("use", ["mixin", "accumulating"])
def test_clone_of_an_accumulating_task_accumulates_alike(use):
    # Keras clones a task through `type(task)(inputs, outputs, name=...)`,
    # which a task's constructor cannot take; plain Keras's clone of a task
    # is a plain functional model. The accumulating task's clone is a
    # functional AccumulatingModel with the task's settings, and trains like
    # it. (The classifier: Keras's clone of the causal LM unties its tied
    # embeddings, for plain Keras too, so that clone is another model.)
    make, task_class, mixin_class, data = TASKS["classifier"]
    if use == "mixin":
        task = make(mixin_class, n_gradients=4, flush_each_epoch=False)
    else:
        task = accumulating(make(task_class), n_gradients=4,
                            flush_each_epoch=False)
    clone = keras.models.clone_model(task)
    assert isinstance(clone, AccumulatingModel)
    assert (clone.n_gradients, clone.flush_each_epoch) == (4, False)
    clone.set_weights(task.get_weights())
    x, y, _ = data(samples=32)
    for model in (task, clone):
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert iterations(task) == iterations(clone) == 2
    assert max_weight_difference(task, clone) <= 1e-6


@jax_only("the check that the suite's step is compiled is JAX's")
def test_the_gpu_suites_child_compiles_the_jax_step():
    # benchmarks/run_benchmarks.py --device gpu times each configuration in
    # a child like this one; on JAX a step run eagerly, op by op, would
    # measure neither what JAX users run nor the window.
    spec = {"device": "cpu", "precision": "float32", "image_size": 32,
            "batch": 2, "n_gradients": 2, "steps": 2, "model": "causal_lm",
            "lm": {"vocabulary_size": 50, "num_layers": 1, "num_heads": 2,
                   "hidden_dim": 16, "intermediate_dim": 32,
                   "max_sequence_length": 8}}
    script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / (
        "run_benchmarks.py")
    result = subprocess.run(
        [sys.executable, str(script), "--backend", "jax",
         "--gpu-child", json.dumps(spec)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["compiled"] is True
    assert figures["accumulator_mib"] > 0


def test_the_fine_tuning_example_is_token_exact_where_keras_option_is_not():
    # examples/finetune_causal_lm.py, as a user runs it, on this backend:
    # accumulating() lands on the large batch's weights with either loss;
    # Keras's gradient_accumulation_steps does only where every micro-batch
    # has the same divisor (the default loss, full micro-batches).
    script = pathlib.Path(__file__).resolve().parent.parent / "examples" / (
        "finetune_causal_lm.py")
    result = subprocess.run([sys.executable, str(script)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # A newcomer reads results only: no start-up or tf.data notices (the
    # "failed call to cuInit" of a machine without a GPU reads like one).
    for notice in ("cuInit", "WARNING", "oneDNN", "prefetch_buffer_size"):
        assert notice not in result.stdout + result.stderr, notice
    figures = [[float(v) for v in re.findall(
        r"^  (?:accumulating|Keras's|  the same|float32).*?(\S+)$", block,
        re.M)] for block in result.stdout.split("max |weight difference|")[1:]]
    assert len(figures) == 2 and all(len(f) == 4 for f in figures), (
        result.stdout)
    for accumulated, keras_option, keras_full_window, floor in figures:
        assert accumulated <= max(10 * floor, 1e-7)
        assert keras_option > 1e3 * max(accumulated, floor)
    (_, _, default_full_window, default_floor), (_, _, token_full_window,
                                                 token_floor) = figures
    assert default_full_window <= max(10 * default_floor, 1e-7)
    assert token_full_window > 1e3 * token_floor


def test_a_task_saved_mid_window_resumes_with_its_adamw_state(tmp_path):
    # keras-hub compiles a task loaded from a .keras file with its default
    # optimizer. Compiling again with AdamW, building it and reading the
    # same file with `load_weights` brings back AdamW's moments as saved,
    # beside the open window load_model restored.
    x, y, weights = _causal_lm_data(samples=20)
    file = str(tmp_path / "mid.keras")

    def compiled():
        model = _causal_lm(SavedGPT2, n_gradients=4)
        model.compile(optimizer=keras.optimizers.AdamW(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), weighted_metrics=[])
        return model

    def fit(model, start=0, callbacks=()):
        model.fit({k: v[start:] for k, v in x.items()}, y[start:],
                  sample_weight=weights[start:], batch_size=2, epochs=1,
                  shuffle=False, verbose=0, callbacks=list(callbacks))

    class SaveAfterSix(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                self.model.save(file)

    reference = compiled()
    fit(reference)
    fit(compiled(), callbacks=[SaveAfterSix()])
    resumed = keras.models.load_model(file)
    assert resumed._accumulation.open_micro_steps() == 2
    resumed.compile(optimizer=keras.optimizers.AdamW(1e-2),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True), weighted_metrics=[])
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(file)
    fit(resumed, start=12)
    assert iterations(resumed) == iterations(reference) == 3
    assert max_weight_difference(resumed, reference) <= 1e-6


@pytest.mark.parametrize("use", ["plain", "mixin"])
def test_the_large_batch_check_copies_a_causal_lm(use):
    # `clone_model` gives a causal LM its tied embedding twice; the check
    # copies it from its config instead.
    from accum_model import compare_with_large_batch

    make, plain_class, mixin_class, make_data = TASKS["causal_lm"]
    model = (make(plain_class) if use == "plain"
             else make(mixin_class, n_gradients=2))
    _compile(model)
    x, y, sample_weight = make_data(samples=16)
    result = compare_with_large_batch(model, x, y,
                                      sample_weight=sample_weight,
                                      batch_size=4, n_gradients=2, steps=2)
    assert result.matches, str(result)
