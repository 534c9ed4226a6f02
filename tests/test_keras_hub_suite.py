"""keras-hub's own task checks, run on accumulating tasks.

keras-hub ships its test helpers (`keras_hub.src.tests.test_case.TestCase`)
in its wheel. `run_task_test` builds the task, checks its config round trip
(`from_config`, `serialize_keras_object`) and its preprocessor, predicts,
fits with and without the preprocessor, and checks that an uncompiled task
refuses to fit; `run_model_saving_test` saves to `.keras`, loads and
compares outputs. Here they run on GPT2CausalLM and BertTextClassifier from
small configs with real tokenizers (a vocabulary written here), with
`AccumulatingModel` mixed in, exactly as a keras-hub user would subclass.
"""

import keras
import numpy as np
import pytest

from accum_model import AccumulatingModel

keras_hub = pytest.importorskip("keras_hub")
test_case = pytest.importorskip(
    "keras_hub.src.tests.test_case",
    reason="keras-hub's test helpers need `grain` (in the test extra)",
)


@keras.saving.register_keras_serializable(package="accum_model_tests")
class AccumulatingGPT2CausalLM(AccumulatingModel,
                               keras_hub.models.GPT2CausalLM):
    def __init__(self, *args, n_gradients=2, **kwargs):
        super().__init__(*args, n_gradients=n_gradients, **kwargs)


@keras.saving.register_keras_serializable(package="accum_model_tests")
class AccumulatingBertTextClassifier(AccumulatingModel,
                                     keras_hub.models.BertTextClassifier):
    def __init__(self, *args, n_gradients=2, **kwargs):
        super().__init__(*args, n_gradients=n_gradients, **kwargs)


# Byte-pair pieces of the few words the sentences below use ("Ġ" marks a
# leading space, as in GPT-2's vocabulary).
_BPE_TOKENS = ["<|endoftext|>", "Ġ", "a", "c", "d", "e", "g", "h", "l", "n",
               "o", "r", "s", "t", "w", "Ġt", "he", "Ġthe", "Ġd", "og",
               "Ġdog", "Ġc", "at", "Ġcat", "Ġs", "ee", "Ġsee", "s"]
_BPE_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ d", "o g", "Ġd og", "Ġ c", "a t",
               "Ġc at", "Ġ s", "e e", "Ġs ee"]
_SENTENCES = [" the dog", " the cat", " the dog see the cat",
              " the cat see the dog"]

_WORDPIECE = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "dog",
              "cat", "sees", "a", "##s"]


def _gpt2_arguments(dropout=0.1):
    vocabulary = {token: i for i, token in
                  enumerate(dict.fromkeys(_BPE_TOKENS))}
    tokenizer = keras_hub.tokenizers.GPT2Tokenizer(
        vocabulary=vocabulary, merges=_BPE_MERGES
    )
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer, sequence_length=8
    )
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=2,
        num_heads=2, hidden_dim=4, intermediate_dim=8,
        max_sequence_length=8, dropout=dropout,
    )
    return {"preprocessor": preprocessor, "backbone": backbone}


class AccumulatingTasksPassKerasHubChecks(test_case.TestCase):

    def gpt2_arguments(self):
        return _gpt2_arguments()

    def bert_arguments(self):
        tokenizer = keras_hub.tokenizers.BertTokenizer(vocabulary=_WORDPIECE)
        preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
            tokenizer, sequence_length=6
        )
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=tokenizer.vocabulary_size(), num_layers=2,
            num_heads=2, hidden_dim=4, intermediate_dim=8,
            max_sequence_length=6,
        )
        return {"preprocessor": preprocessor, "backbone": backbone,
                "num_classes": 2}

    def test_causal_lm_task_checks(self):
        self.run_task_test(
            cls=AccumulatingGPT2CausalLM,
            init_kwargs=self.gpt2_arguments(),
            train_data=(_SENTENCES,),
            expected_output_shape=(4, 8, len(set(_BPE_TOKENS))),
        )

    def test_causal_lm_saving_checks(self):
        arguments = self.gpt2_arguments()
        tokens = arguments["preprocessor"](_SENTENCES)[0]
        self.run_model_saving_test(
            cls=AccumulatingGPT2CausalLM, init_kwargs=arguments,
            input_data=tokens,
        )

    def test_classifier_task_checks(self):
        self.run_task_test(
            cls=AccumulatingBertTextClassifier,
            init_kwargs=self.bert_arguments(),
            train_data=(["the dog", "the cat sees a dog", "a cat",
                         "the dogs"], np.array([0, 1, 1, 0])),
            expected_output_shape=(4, 2),
        )

    def test_classifier_saving_checks(self):
        arguments = self.bert_arguments()
        features = arguments["preprocessor"](["the dog", "a cat"])
        self.run_model_saving_test(
            cls=AccumulatingBertTextClassifier, init_kwargs=arguments,
            input_data=features,
        )


def _compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.5), weighted_metrics=[])
    return model


class _SavePresetAfter(keras.callbacks.Callback):
    def __init__(self, batch, path):
        super().__init__()
        self.batch, self.path = batch, path
        self.open_micro_steps = None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.save_to_preset(self.path)
            self.open_micro_steps = (
                self.model._accumulation.open_micro_steps())


def test_raw_strings_train_through_a_preset_saved_with_the_window_open(
        tmp_path):
    # A fine-tuner's day: fit() on raw strings through the task's
    # preprocessor, a preset saved between two updates, loaded and trained
    # on: the large batch's weights, and generate() works.
    sentences = _SENTENCES * 2
    keras.utils.set_random_seed(2)
    plain = _compiled(keras_hub.models.GPT2CausalLM(
        **_gpt2_arguments(dropout=0.0)))
    # Windows carried across epochs: the epoch of 3 micro-batches leaves
    # its window open.
    model = _compiled(AccumulatingGPT2CausalLM(
        **_gpt2_arguments(dropout=0.0), n_gradients=4,
        flush_each_epoch=False))
    model.set_weights(plain.get_weights())
    plain.fit(sentences, batch_size=8, epochs=1, shuffle=False, verbose=0)

    preset = str(tmp_path / "preset")
    saving = _SavePresetAfter(2, preset)
    model.fit(sentences[:6], batch_size=2, epochs=1, shuffle=False,
              verbose=0, callbacks=[saving])
    assert saving.open_micro_steps == 3
    loaded = _compiled(AccumulatingGPT2CausalLM.from_preset(preset))
    assert (loaded.n_gradients, loaded.flush_each_epoch) == (4, False)
    assert loaded._accumulation.open_micro_steps() == 3
    loaded.fit(sentences[6:], batch_size=2, epochs=1, shuffle=False,
               verbose=0)
    assert int(loaded.optimizer.iterations) == 1
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(
        plain.get_weights(), loaded.get_weights())) <= 1e-6
    generated = loaded.generate(["the dog"], max_length=8)
    assert len(generated) == 1 and str(generated[0]).startswith("the dog")
