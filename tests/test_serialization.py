"""Saving and loading: the class, n_gradients and optimizer state come back."""

import numpy as np

from accum_model import AccumulatingModel
from backends import keras_2_too
from helpers import keras
from helpers import iterations
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data

pytestmark = keras_2_too


def test_keras_file_round_trip_and_training_continues(tmp_path):
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients=4, flush_each_epoch=False)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  metrics=["mae"])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)

    loaded = keras.models.load_model(path)
    assert isinstance(loaded, AccumulatingModel)
    assert type(loaded).__name__ == "AccumulatingModel"
    assert loaded.n_gradients == 4
    assert loaded.flush_each_epoch is False
    assert iterations(loaded) == iterations(model) == 2
    for saved, restored in zip(model.optimizer.variables,
                               loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())

    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert iterations(loaded) == 4
    assert max_weight_difference(model, loaded) == 0.0


@keras.saving.register_keras_serializable(package="accum_model_tests")
class RegisteredNet(AccumulatingModel):
    def __init__(self, units=5, n_gradients=3, **kwargs):
        super().__init__(n_gradients=n_gradients, **kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_subclassed_round_trip(tmp_path):
    x, y = regression_data(samples=48)
    model = RegisteredNet(units=7, n_gradients=3)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
                  loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "net.keras")
    loaded = keras.models.load_model(tmp_path / "net.keras")
    assert type(loaded) is RegisteredNet
    assert (loaded.units, loaded.n_gradients) == (7, 3)
    assert iterations(loaded) == 2
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_weight_difference(model, loaded) == 0.0


def test_weights_files_load_into_a_fresh_model(tmp_path):
    x, y = regression_data(samples=32)
    model = mlp(AccumulatingModel, n_gradients=2)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.save_weights(tmp_path / "trained.weights.h5")

    fresh = mlp(AccumulatingModel, n_gradients=2, seed=99)
    fresh.load_weights(tmp_path / "trained.weights.h5")
    assert max_weight_difference(model, fresh) == 0.0

    plain = mlp(keras.Model, seed=98)
    plain.load_weights(tmp_path / "trained.weights.h5")
    assert max_weight_difference(model, plain) == 0.0


@keras.saving.register_keras_serializable(package="accum_model_tests")
class OwnFromConfig(keras.Model):
    """A model class whose `from_config` takes no `custom_objects`, as
    keras-hub's `Task.from_config(cls, config)` and many user classes."""

    def __init__(self, units=5, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def get_config(self):
        return {**super().get_config(), "units": self.units}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@keras.saving.register_keras_serializable(package="accum_model_tests")
class AccumulatingOwnFromConfig(AccumulatingModel, OwnFromConfig):
    def __init__(self, *args, n_gradients=2, **kwargs):
        super().__init__(*args, n_gradients=n_gradients, **kwargs)


def test_next_from_config_without_custom_objects(tmp_path):
    x, y = regression_data(samples=48)
    model = AccumulatingOwnFromConfig(units=7, n_gradients=3,
                                      flush_each_epoch=False)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    rebuilt = AccumulatingOwnFromConfig.from_config(model.get_config())
    assert (rebuilt.units, rebuilt.n_gradients, rebuilt.flush_each_epoch) == (
        7, 3, False)

    model.save(tmp_path / "own.keras")
    loaded = keras.models.load_model(tmp_path / "own.keras")
    assert type(loaded) is AccumulatingOwnFromConfig
    assert (loaded.units, loaded.n_gradients, loaded.flush_each_epoch) == (
        7, 3, False)
    assert iterations(loaded) == iterations(model) == 2
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_weight_difference(model, loaded) <= 1e-6
