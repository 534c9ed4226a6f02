"""The accumulating training step on TensorFlow, for either Keras.

Keras 3 on TensorFlow and Keras 2 train with the same stateful step: a
`tf.GradientTape` over one micro-batch, its gradients handed to the window
in replica context. What differs between the two Kerases (how a loss is
computed, reduced and logged, how normalization layers are intercepted)
comes from each Keras's `Adapter`, handed in as `adapter`: its `losses`
part, `unpack_x_y_sample_weight`, `logs_for_reduction`,
`recording_batch_statistics` and `recording_loss_reductions`. Both
adapters take their step's answers from `TensorFlowSteps`.
"""

import functools

import tensorflow as tf

from accum_model.core import class_tree
from accum_model.core import divisor
from accum_model.core import micro_step
from accum_model.core.adapter import Adapter
from accum_model.tensorflow import replicas
from accum_model.tensorflow.ops import TF_OPS
from accum_model.tensorflow.ops import TF_SHAPES


def train_step(model, data, adapter: Adapter):
    """One step of `model` on `data` (replica context): one micro step, or
    one per micro-batch of at most `micro_batch_size` samples.

    Args:
        model: The accumulating model.
        data: The batch, as Keras hands it to `train_step`.
        adapter: The Keras adapter (see the module's docstring).

    Returns:
        The logs of the step.
    """
    accumulation = model._accumulation
    data = _owned_by_the_step(data, model.distribute_strategy)
    if accumulation.settings.micro_batch_size is None:
        x, y, y_pred, sample_weight, _ = _micro_step(model, data, adapter)
        logs = model.compute_metrics(x, y, y_pred,
                                     sample_weight=sample_weight)
    else:
        logs = _micro_batches_step(model, data, adapter)
    window = accumulation.window
    logs = micro_step.logged(
        logs, window.skipped_windows.value, accumulation.loss_scaling.active,
        accumulation.settings)
    return adapter.logs_for_reduction(logs, model.distribute_strategy)


def _micro_batches_step(model, data, adapter):
    """The batch `data` split into micro-batches of at most
    `micro_batch_size` samples (`core.micro_step`), each a micro step of
    the window, which may end after the last. The first runs outside the
    loop: the step's first trace creates the window's variables there."""
    accumulation = model._accumulation
    x, _, _ = adapter.unpack_x_y_sample_weight(data)
    micro_batch_size = accumulation.micro_batch_size_for(
        None, 1, _chosen_as_fit_starts, "")
    count = micro_step.micro_batch_count(
        divisor.batch_size(x, TF_SHAPES), micro_batch_size, TF_OPS)

    def micro_batch(start):
        return tf.nest.map_structure(
            lambda value: _rows(value, start, micro_batch_size), data)

    def metrics_updated(x, y, y_pred, sample_weight, _):
        # Read once, after the window's end: Keras 2 reads a metric under
        # replicas with a `merge_call`, which no loop may hold.
        model.get_metrics_result = dict
        try:
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        finally:
            del model.get_metrics_result

    def next_micro_batch(index):
        metrics_updated(*_micro_step(
            model, micro_batch(index * micro_batch_size), adapter,
            counts=False, may_end=False))
        return (index + 1,)

    accumulation.micro_batches_in_step = count
    try:
        x, y, y_pred, sample_weight, has_data = _micro_step(
            model, micro_batch(0), adapter, may_end=False)
        metrics_updated(x, y, y_pred, sample_weight, has_data)
        if not (isinstance(count, int) and count == 1):
            tf.while_loop(lambda index: index < count, next_micro_batch,
                          (tf.ones_like(count),))
        accumulation.end_window_if_due(has_data)
    finally:
        # A trace that raised leaves no tensor of its graph behind.
        accumulation.micro_batches_in_step = 1
    return model.get_metrics_result()


def _chosen_as_fit_starts(size):
    del size
    raise ValueError(
        "micro_batch_size=\"auto\" on TensorFlow is chosen as fit() starts, "
        "from its first batch (the step is traced for every size of batch "
        "at once): call fit(), or give micro_batch_size an integer for "
        "`train_on_batch` and loops of your own. Received: "
        "micro_batch_size=\"auto\"")


def choose_micro_batch_size(model, fit_arguments, adapter: Adapter):
    """`micro_batch_size="auto"` on TensorFlow: the largest micro-batch of a
    replica's share of `fit()`'s first batch whose forward and backward
    pass runs without an out-of-memory error (`passes_fit`), chosen once,
    as `fit()` starts."""
    x = _first_batch_inputs(fit_arguments, adapter)
    replicas = model.distribute_strategy.num_replicas_in_sync
    batch_size = -(-int(divisor.batch_size(x, TF_SHAPES)) // replicas)
    model._accumulation.micro_batch_size_for(
        None, batch_size, lambda size: passes_fit(model, x, size),
        "the largest tried without an out-of-memory error")


def _first_batch_inputs(fit_arguments, adapter: Adapter):
    """The inputs of the first batch `fit()` will train on (its shape is
    what counts), read without taking it from the data."""
    x = fit_arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        return adapter.unpack_x_y_sample_weight(next(iter(x.take(1))))[0]
    if hasattr(x, "__getitem__") and hasattr(x, "__len__") and not (
            isinstance(x, (dict, list, tuple)) or hasattr(x, "shape")):
        # A `PyDataset` (or Keras 2's `Sequence`): its first batch.
        return adapter.unpack_x_y_sample_weight(x[0])[0]
    if x is None or not all(hasattr(value, "shape")
                            for value in tf.nest.flatten(x)):
        raise ValueError(
            "micro_batch_size=\"auto\" on TensorFlow sizes micro-batches "
            "from fit()'s first batch, which it reads from arrays, a "
            "`tf.data.Dataset` or a `PyDataset` without taking it from the "
            "data; a generator cannot be read so. Give micro_batch_size an "
            f"integer. Received: x of type {type(x).__name__}")
    batch_size = fit_arguments.get("batch_size") or 32
    return tf.nest.map_structure(lambda value: value[:batch_size], x)


def passes_fit(model, x, size):
    """Whether a forward and backward pass on the first `size` samples of
    `x` runs without TensorFlow's out-of-memory error. Leaves the model as
    it was: its non-trainable variables (moving statistics, seeds) are put
    back."""
    saved = [tf.identity(variable) for variable in
             model.non_trainable_variables]
    rows = tf.nest.map_structure(
        lambda value: value if len(value.shape) == 0 else value[:size], x)
    try:
        with tf.GradientTape() as tape:
            y_pred = model(rows, training=True)
            total = tf.add_n([tf.reduce_sum(tf.cast(value, tf.float32))
                              for value in tf.nest.flatten(y_pred)])
        tape.gradient(total, model.trainable_variables)
        return True
    except tf.errors.ResourceExhaustedError:
        return False
    finally:
        for variable, value in zip(model.non_trainable_variables, saved):
            variable.assign(value)


def _rows(value, start, size):
    """Rows `start` to `start + size` of a batch's tensor."""
    if isinstance(value, tf.SparseTensor):
        raise ValueError(
            "`micro_batch_size` splits a batch's dense and ragged tensors; "
            "a `tf.SparseTensor` input cannot be split. Pass it dense, or "
            "set micro_batch_size=None and batches of the micro-batch's "
            "size with n_gradients instead. Received: a SparseTensor of "
            f"shape {value.shape}")
    if not isinstance(value, (tf.Tensor, tf.RaggedTensor)) or (
            value.shape.rank == 0):
        return value
    return value[start:start + size]


def _micro_step(model, data, adapter, counts=None, may_end=True):
    """One micro-batch into the window (see `add_micro_batch`'s `counts`
    and `may_end`); returns its x, y, predictions, sample weights and
    whether some replica had data."""
    accumulation = model._accumulation
    x, y, sample_weight = adapter.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        # BatchNormalization's moving statistics move once per window,
        # from the window's pooled moments (see `batch_statistics`).
        with adapter.recording_batch_statistics(
                class_tree.layers_of(model),
                accumulation.spectral_writes()) as statistics:
            y_pred = model(x, training=True)
        # This replica's own mean loss, never divided by the replicas:
        # the window end divides by the whole window's weight instead.
        with adapter.losses.losses_not_divided_by_replicas(), \
                adapter.losses.loss_logged_by_window(model), \
                adapter.recording_loss_reductions() as reductions:
            loss = adapter.losses.compute_loss(
                model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight
            )
        # Every weight exists now; loss scaling reads the window.
        accumulation.ensure_state(
            model.trainable_variables, model.distribute_strategy,
            [record.call for record in statistics],
        )
        divide_by_weight = micro_step.loss_reduced(
            model, reductions, y_pred, adapter.losses.get_keras_mask,
            TF_SHAPES)
        accumulation.window.divide_by_weight = divide_by_weight
        scaled_loss = model.get_scaled_loss(loss)
    window = accumulation.window
    gradients = tape.gradient(scaled_loss, window.trainable_variables)
    gradients = model.get_unscaled_gradients(gradients)
    batch_size = divisor.batch_size(x, TF_SHAPES)

    # The loss is a mean over `weight` elements; multiplying it back
    # gives the gradient of the summed loss, which the window end
    # divides by the window's total weight.
    weight = tf.cast(
        model.micro_batch_weight(x, y, y_pred, sample_weight), tf.float32
    )
    # The loss in logs is the window's, logged once when it ends.
    has_data = accumulation.add_micro_batch(
        gradients, weight, batch_size, divide_by_weight=divide_by_weight,
        loss=loss, statistics=statistics, counts=counts, may_end=may_end)
    return x, y, y_pred, sample_weight, has_data


def _owned_by_the_step(data, strategy):
    """The micro-batch, copied where TensorFlow may write into the user's
    arrays.

    Under a strategy of several replicas on CPUs, a replica's share of a
    batch that `tf.data.Dataset.from_generator` took from the user's NumPy
    arrays (views, such as `x[i:j]`) can share their memory, and an op of
    the step that reuses its input's buffer for its output then writes into
    them: the next epoch reads corrupted targets (tensorflow 2.21, plain
    Keras as well, in about a third of processes). A copy per micro step
    costs one micro-batch's bytes on the replica.
    """
    if strategy.num_replicas_in_sync < 2 or not any(
            "CPU" in device.upper()
            for device in strategy.extended.worker_devices):
        return data
    return tf.nest.map_structure(
        lambda value: (tf.raw_ops.DeepCopy(x=value)
                       if isinstance(value, tf.Tensor) else value), data)


def default_micro_batch_weight(model, x, y_pred, adapter: Adapter):
    """What Keras divided this micro step's loss by (`divisor`)."""
    return divisor.default_weight(model, x, y_pred,
                                  adapter.losses.get_keras_mask,
                                  TF_SHAPES)


def evaluating_like_one_device(model, test_function, adapter: Adapter):
    """`model`'s `test_function`, in which, under several replicas, each
    loss Keras reduces is the whole batch's
    (`replicas.reduced_as_one_device`), where Keras's own evaluation
    averages the replicas' own means (a mean over valid elements, or
    weights, strays from one device's, as a "sum" does). Keras divides no
    loss by the replicas there: each already is the whole batch's.
    `adapter` is the Keras adapter (`losses_not_divided_by_replicas`,
    `recording_loss_reductions`, `SUMS_LOGGED_PER_REPLICA`).

    The replacement is made around the whole function, from the calling
    thread: MirroredStrategy traces each replica in a thread of its own
    and switches between them at each collective, so a replacement made
    and undone inside one replica's step would cross another's.
    """
    if model.distribute_strategy.num_replicas_in_sync == 1:
        return test_function

    @functools.wraps(test_function)
    def test_function_of_one_device(*args, **kwargs):
        with adapter.losses.losses_not_divided_by_replicas(), \
                adapter.losses.tracker_weighing_all_samples(
                    model, _summed_over_replicas), \
                adapter.recording_loss_reductions(
                    reduced=functools.partial(
                        replicas.reduced_as_one_device,
                        sums_logged_per_replica=(
                            adapter.SUMS_LOGGED_PER_REPLICA))):
            return test_function(*args, **kwargs)

    return test_function_of_one_device


def _summed_over_replicas(samples):
    """Replica context: `samples` summed over the replicas, in float32."""
    return replicas.sum_over_replicas(lambda: tf.cast(samples, tf.float32))


def check_strategy(strategy):
    """Refuses distribution strategies whose variables live off-replica."""
    unsupported = (
        tf.distribute.experimental.ParameterServerStrategy,
        tf.distribute.experimental.CentralStorageStrategy,
    )
    if isinstance(strategy, unsupported):
        raise ValueError(
            "AccumulatingModel supports the default strategy, "
            "OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy "
            "and TPUStrategy, which keep a copy of every variable on each "
            "replica. Received: distribute_strategy="
            f"{strategy.__class__.__name__}"
        )


class TensorFlowSteps:
    """What an `Adapter` on TensorFlow answers of the step, in either Keras:
    the micro step, evaluation as one device, the default micro-batch
    weight, the replicas, and the gradients of a step of the user's own."""

    def accumulating_train_step(self, model, data):
        return train_step(model, data, adapter=self)

    def unpack_x_y_sample_weight(self, data):
        return self.keras.utils.unpack_x_y_sample_weight(data)

    def evaluating_like_one_device(self, model, test_function):
        return evaluating_like_one_device(model, test_function,
                                          adapter=self)

    def choose_micro_batch_size(self, model, fit_arguments):
        choose_micro_batch_size(model, fit_arguments, adapter=self)

    def default_micro_batch_weight(self, model, x, y_pred):
        return default_micro_batch_weight(model, x, y_pred, adapter=self)

    @staticmethod
    def replicas_in_sync(model):
        """Int. Replicas the model trains on (its strategy's)."""
        return model.distribute_strategy.num_replicas_in_sync

    @staticmethod
    def accumulate_gradients(model, gradients, weight, batch_size=None):
        """`AccumulatingModel.accumulate_gradients` (replica context)."""
        accumulation = model._accumulation
        accumulation.ensure_state(model.trainable_variables,
                                  model.distribute_strategy)
        weight = tf.cast(weight, tf.float32)
        if batch_size is None:
            batch_size = tf.constant(1)
        accumulation.add_micro_batch(list(gradients), weight, batch_size)
