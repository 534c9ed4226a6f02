"""Two replicas (MirroredStrategy on two logical CPUs) equal one device."""

import keras
import numpy as np
import pytest

from accum_model import AccumulatingModel
from helpers import fit_both
from helpers import iterations
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data
from test_exactness import OPTIMIZERS
from test_exactness import _masked_lstm
from test_exactness import _padded_sequences

TOLERANCE = 1e-5


@pytest.mark.parametrize(
    "name", ["sgd", "adam", "rmsprop_clipnorm", "adam_global_clipnorm",
             "sgd_clipvalue"]
)
def test_two_replicas_match_one_device_large_batch(name, two_replicas):
    # 100 samples: the last micro-batch (4 samples) is split 2 + 2.
    x, y = regression_data(samples=100)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS[name], x, y, micro_batch=8, n_gradients=4,
        epochs=2, strategy=two_replicas,
    )
    assert iterations(accumulating) == iterations(plain) == 8
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_uneven_split_across_replicas(two_replicas):
    # The last micro-batch (3 samples) splits 2 + 1: each replica divides its
    # loss by its own sample count, which the window weighting undoes.
    x, y = regression_data(samples=99)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["sgd"], x, y, micro_batch=8, n_gradients=4,
        epochs=1, strategy=two_replicas,
    )
    assert iterations(accumulating) == iterations(plain) == 4
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_every_micro_batch_split_unevenly(two_replicas):
    # Micro-batches of 7 split 4 + 3, from the first one on (plain Keras
    # 3.15.1 cannot even build from such a first batch under the strategy).
    x, y = regression_data(samples=98)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["sgd"], x, y, micro_batch=7, n_gradients=2,
        epochs=1, strategy=two_replicas,
    )
    assert iterations(accumulating) == iterations(plain) == 7
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_masked_sequences_with_different_valid_counts_per_replica(
    two_replicas,
):
    x, y = _padded_sequences()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = _masked_lstm(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss)
    with two_replicas.scope():
        accumulating = _masked_lstm(AccumulatingModel, n_gradients=4)
        accumulating.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss)
    accumulating.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    accumulating.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_run_eagerly_under_two_replicas(two_replicas):
    x, y = regression_data(samples=48)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["adam"], x, y, micro_batch=8, n_gradients=3,
        epochs=1, strategy=two_replicas,
        compile_kwargs={"run_eagerly": True},
    )
    assert iterations(accumulating) == iterations(plain) == 2
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_subclassed_model_under_two_replicas(two_replicas):
    from test_exactness import SubclassedNet

    x, y = regression_data(samples=64)
    keras.utils.set_random_seed(3)
    with two_replicas.scope():
        accumulating = SubclassedNet(n_gradients=4)
        accumulating.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    accumulating.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert iterations(accumulating) == 2
    assert np.all(np.isfinite(accumulating.get_weights()[0]))
