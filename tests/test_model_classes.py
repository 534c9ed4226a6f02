"""The mixin on any Keras model class, `accumulating(model)`, constructors.

No use of a class may change another class; settings survive clones; a
misspelt constructor argument is an error, not a silent default.
"""

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import accumulating
from accum_model import compare_with_large_batch
from backends import keras_2_too
from backends import keras_3_only
from helpers import iterations
from helpers import keras
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data
from helpers import run_script_printing_ok

pytestmark = keras_2_too


class Net(AccumulatingModel):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


# Constructor arguments ------------------------------------------------------

@pytest.mark.parametrize("misspelt, meant", [
    ("n_gradient", "n_gradients"),
    ("flush_each_epochs", "flush_each_epoch"),
    ("trainabel", "trainable"),
])
def test_misspelt_argument_is_a_type_error_for_functional_models(misspelt,
                                                                 meant):
    with pytest.raises(TypeError, match=f"'{misspelt}'.*`{meant}`"):
        mlp(AccumulatingModel, **{misspelt: 4})


def test_misspelt_argument_is_a_type_error_for_subclassed_models():
    with pytest.raises(TypeError, match="'n_gradient'.*`n_gradients`"):
        Net(n_gradient=4)


def test_arguments_keras_accepts_still_work():
    model = mlp(AccumulatingModel, n_gradients=2, name="named",
                trainable=False)
    assert model.name == "named" and not model.trainable
    assert Net(n_gradients=2, name="net", dtype="float32").name == "net"


# Clones ----------------------------------------------------------------------

def test_clone_of_functional_model_keeps_class_and_settings():
    model = mlp(AccumulatingModel, n_gradients=4, flush_each_epoch=False)
    clone = keras.models.clone_model(model)
    assert isinstance(clone, AccumulatingModel)
    assert (clone.n_gradients, clone.flush_each_epoch) == (4, False)
    default = keras.models.clone_model(mlp(AccumulatingModel))
    assert (default.n_gradients, default.flush_each_epoch) == (1, True)


def test_clone_of_subclassed_model_keeps_class_and_settings():
    clone = keras.models.clone_model(Net(units=5, n_gradients=3,
                                         flush_each_epoch=False))
    assert type(clone) is Net
    assert (clone.n_gradients, clone.flush_each_epoch, clone.units) == (
        3, False, 5)


def test_cloned_model_trains_like_the_large_batch():
    x, y = regression_data(samples=64)
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    clone = keras.models.clone_model(mlp(AccumulatingModel, n_gradients=4))
    clone.set_weights(mlp(keras.Model).get_weights())
    clone.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    clone.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert iterations(clone) == 2
    assert max_weight_difference(plain, clone) <= 1e-6


@pytest.mark.parametrize("compiled", [False, True])
def test_clone_of_an_accumulating_sequential_accumulates(compiled):
    # Keras clones every Sequential as a plain one; the clone of an
    # accumulating one must not train without accumulating.
    x, y = regression_data(samples=96)
    large = _sequential()
    large.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model = accumulating(_sequential(), n_gradients=4,
                         flush_each_epoch=False)
    plain = _sequential()
    if compiled:
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    clone = keras.models.clone_model(model)
    assert isinstance(clone, keras.Sequential)
    assert isinstance(clone, AccumulatingModel)
    assert (clone.n_gradients, clone.flush_each_epoch) == (4, False)
    # Compiled as Keras compiles a plain clone (Keras 3 does, Keras 2 not).
    assert _is_compiled(clone) is _is_compiled(
        keras.models.clone_model(plain))
    clone.set_weights(large.get_weights())
    clone.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    large.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    clone.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert iterations(clone) == iterations(large) == 6
    assert max_weight_difference(large, clone) <= 1e-6
    # A plain Sequential's clone stays plain.
    assert not isinstance(keras.models.clone_model(large), AccumulatingModel)


def _is_compiled(model):
    # Keras 2 calls it `_is_compiled`.
    return getattr(model, "compiled", getattr(model, "_is_compiled", None))


# Any class, any order ------------------------------------------------------

_ANY_ORDER = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import {keras} as keras, numpy as np
from accum_model import AccumulatingModel

class Plain(keras.Model):
    '''Builds itself functionally in __init__, as keras-hub tasks do.'''
    def __init__(self, units=2, **kwargs):
        inputs = keras.Input((3,))
        super().__init__(inputs=inputs,
                         outputs=keras.layers.Dense(units)(inputs), **kwargs)

class Mixed(AccumulatingModel, Plain):
    pass

class Net(AccumulatingModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)
    def call(self, inputs):
        return self.dense(inputs)

def functional():
    inputs = keras.Input((3,))
    return AccumulatingModel(inputs=inputs,
                             outputs=keras.layers.Dense(2)(inputs),
                             n_gradients=2)

makers = {"plain": lambda: Plain(), "mixed": lambda: Mixed(n_gradients=2),
          "subclassed": lambda: Net(n_gradients=2), "functional": functional}
# Keras itself rewrites Plain's bases when Plain is built on its own.
ours = (AccumulatingModel, Mixed, Net, keras.Model)
bases = {c: c.__bases__ for c in ours + ((Plain,) if "plain" not in [{order}]
                                          else ())}
x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
for name in [{order}]:
    model = makers[name]()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, verbose=0)
    expected = 2 if name == "plain" else 1
    assert int(model.optimizer.iterations.numpy()) == expected, name
    assert isinstance(model, AccumulatingModel) == (name != "plain"), name
    # Not swapped for Keras's `Functional`.
    assert type(model).__name__ in ("Plain", "Mixed", "Net",
                                    "AccumulatingModel"), name
assert {c: c.__bases__ for c in bases} == bases
print("ok")
"""


@pytest.mark.parametrize("order", [
    "'plain', 'mixed', 'mixed', 'subclassed', 'functional'",
    "'subclassed', 'mixed', 'functional', 'plain', 'mixed', 'subclassed'",
    "'functional', 'mixed', 'subclassed', 'mixed', 'plain', 'functional'",
])
def test_every_kind_of_class_in_any_order_changes_no_class(order):
    run_script_printing_ok(_ANY_ORDER.replace("{order}", order))


# accumulating(model) ---------------------------------------------------------

def _plain_large_batch(x, y, epochs=2):
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return plain


def _sequential():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    model.set_weights(mlp(keras.Model).get_weights())
    return model


@pytest.mark.parametrize("make", [lambda: mlp(keras.Model), _sequential])
def test_accumulating_makes_an_existing_model_match_the_large_batch(make):
    x, y = regression_data(samples=64)
    plain = _plain_large_batch(x, y)
    model = make()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.make_train_function()  # as a first fit() makes it
    original_class = type(model)
    same = accumulating(model, n_gradients=4)
    assert same is model
    assert isinstance(model, AccumulatingModel)
    assert isinstance(model, original_class)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert iterations(model) == 4
    assert max_weight_difference(plain, model) <= 1e-6
    # Keras would have injected `Functional` into the bases.
    assert AccumulatingModel.__bases__[-1] is keras.Model
    assert not issubclass(AccumulatingModel, type(mlp(keras.Model)))


def test_accumulating_functional_model_round_trips_through_keras_file(
        tmp_path):
    x, y = regression_data(samples=64)
    model = accumulating(mlp(keras.Model), n_gradients=4,
                         flush_each_epoch=False)
    model.compile(optimizer="sgd", loss="mse")
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert isinstance(loaded, AccumulatingModel)
    assert (loaded.n_gradients, loaded.flush_each_epoch) == (4, False)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))


def test_accumulating_keeps_the_class_methods_and_compute_loss():
    class Doubled(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None,
                         sample_weight=None, training=True):
            return 2.0 * keras.losses.MeanSquaredError()(y, y_pred)

        def greeting(self):
            return "hello"

    x, y = regression_data(samples=64)
    plain = mlp(Doubled)
    plain.compile(optimizer=keras.optimizers.SGD(0.05))
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model = accumulating(mlp(Doubled), n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    # A mean over samples: the sample-count weight (announced) is exact.
    with pytest.warns(UserWarning, match="micro_batch_weight"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert model.greeting() == "hello"
    assert iterations(model) == 2
    assert max_weight_difference(plain, model) <= 1e-6


def test_accumulating_refuses_other_settings_with_a_window_open():
    x, y = regression_data(samples=8)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss="mse")
    assert accumulating(model, n_gradients=4) is model
    model.train_on_batch(x, y)
    with pytest.raises(ValueError, match="window open"):
        accumulating(model, n_gradients=2)
    model.apply_open_window()
    assert accumulating(model, n_gradients=2).n_gradients == 2


def test_accumulating_refuses_what_is_not_a_keras_model():
    with pytest.raises(ValueError, match="keras.Model"):
        accumulating(object(), n_gradients=2)
    with pytest.raises(ValueError, match="n_gradients"):
        accumulating(mlp(keras.Model), n_gradients=0)


@keras_3_only("under Keras 2, tf_keras is the Keras that accumulates")
@pytest.mark.parametrize("taker", ["accumulating", "compare"])
def test_a_tf_keras_model_is_refused_with_the_fix(taker):
    tf_keras = pytest.importorskip("tf_keras")
    model = tf_keras.Sequential([tf_keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="TF_USE_LEGACY_KERAS=1"):
        if taker == "accumulating":
            accumulating(model, n_gradients=2)
        else:
            compare_with_large_batch(model, np.zeros((4, 1)), np.zeros(4),
                                     batch_size=2, n_gradients=2)


def test_class_whose_train_step_would_be_shadowed_is_warned_about():
    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    x, y = regression_data(samples=16)
    model = accumulating(mlp(OwnStep), n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match="OwnStep.train_step is not used"):
        model.fit(x, y, batch_size=8, verbose=0)
