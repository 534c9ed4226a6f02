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


class AccumulatingTasksPassKerasHubChecks(test_case.TestCase):

    def gpt2_arguments(self):
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
            max_sequence_length=8,
        )
        return {"preprocessor": preprocessor, "backbone": backbone}

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
