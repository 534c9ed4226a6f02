"""Keras 3 on JAX: the window inside a pure training step.

Keras's JAX trainer (`keras/src/backend/jax/trainer.py`) jit-compiles a pure
`train_step(state, data)`, where `state` is the values of the trainable,
non-trainable, optimizer and metrics variables, and writes the values back
into the variables only at the end of an epoch (`jax_state_sync`). The
window's state (`WindowState`: accumulators and counters) rides in that
state behind the optimizer's variables: `JaxModelDifferences._get_jax_state`
appends it and `jax_state_sync` takes it back, so it is never a variable of
the model or of the optimizer (`get_weights()` and optimizer files stay what
plain Keras writes). Each micro step adds its gradient, times what Keras
divided its loss by, to the window; the window is applied with the
optimizer's own `stateless_apply` when it is full or the epoch ends, by one
`lax.cond` (on a GPU, computed in every micro step and kept only then; see
`jax_window`).
The numbers are `accum_model.core.arithmetic`'s and `divisor`'s.

Keras's JAX loop learns that data ran out before it runs a step, so no step
ever runs on an empty batch; the window still open at an epoch's end is
applied eagerly by the window callback, after Keras has written the state
back into the variables.

Under `keras.distribution` (`DataParallel`, `ModelParallel`) the step is
one program over the sharded micro-batch, as Keras's own. Under
`ModelParallel` the window's gradient sums are laid out as their variables
and XLA reduces the gradient across devices where it computes it, on every
micro step. Under `DataParallel` each device adds its own share of the
gradient to its own block of the sums (`per_device_gradients`: the
BatchNormalization moments combined across devices, a random stream per
device), and the window's end reduces them once.

BatchNormalization layers' moving statistics are pooled over the window
(`stateless_normalization`). The open window is saved in Keras files, laid out
as on TensorFlow.

Not on JAX (each refused by name before training): another
`keras.distribution.Distribution`, float64 accumulators without
`jax_enable_x64`, and `accumulate_gradients` (a step of the user's own
calls `stateless_accumulate_gradients` instead).

Private Keras members used, checked on keras 3.15.1 with jax 0.10.2:
`_get_jax_state`, `jax_state_sync`, `_jax_state`, `_jax_state_synced`,
`stateless_call`, `stateless_compute_loss`, `_losses_override`,
`_call_has_training_arg`, `_loss_tracker`, `_get_state_sharding_spec`,
`Layer._seed_generators` (also on keras 3.10.0).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import keras
from keras.src.backend.jax import random as jax_random

from accum_model.core import arithmetic
from accum_model.core import class_tree
from accum_model.core import divisor
from accum_model.core import micro_step
from accum_model.core.window import WindowState
from accum_model.keras3 import losses
from accum_model.keras3 import jax_window
from accum_model.keras3 import stateless_window
from accum_model.keras3.jax_window import JaxAccumulation
from accum_model.keras3.jax_window import window_sharding as _window_sharding
from accum_model.keras3.stateless_adapter import StatelessAdapter
from accum_model.keras3.stateless_ops import KERAS_OPS
from accum_model.keras3.stateless_ops import KERAS_SHAPES


def micro_batches_step(model, state, data, micro_batch_size=None):
    """One step on JAX whose batch is split into micro-batches of at most
    `micro_batch_size` samples per device (`core.micro_step`), run one
    after another inside the compiled step: pure, `(state, data) ->
    (logs, state)`.

    The micro-batches of full size but the last run in a `lax.scan`, which
    holds one micro-batch's activations at a time (steps written out one
    after another let XLA keep every micro-batch's alive at once); the
    last, the one the window may end with, runs after it. Under
    `DataParallel` each device splits its own rows: a micro-batch holds
    every device's next block of rows, so no row moves between devices,
    and the window's sums stay per device until the window ends.
    """
    accumulation = model._accumulation
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    batch_size = int(divisor.batch_size(x, KERAS_SHAPES))
    devices = jax_window.batch_devices()
    if batch_size % devices:
        devices = 1
    if micro_batch_size is None:
        micro_batch_size = accumulation.settings.micro_batch_size
    if micro_batch_size == "auto":
        limit = memory_limit(accumulation.settings)
        micro_batch_size = accumulation.micro_batch_size_for(
            tuple(jnp.shape(leaf) for leaf in jax.tree.leaves(data)),
            batch_size // devices,
            lambda size: step_bytes(model, state, data, size) <= limit,
            f"a compiled step within {limit:,} bytes")
    bounds = micro_step.micro_batch_bounds(batch_size // devices,
                                           micro_batch_size)
    scanned = len(bounds) - 1

    def rows(start, size):
        # `start` may be traced: each device's rows `start` to
        # `start + size`, devices' blocks one after another.
        def of(value):
            if jnp.ndim(value) == 0:
                return value
            shape = tuple(jnp.shape(value))
            blocks = jax.lax.dynamic_slice_in_dim(
                jnp.reshape(value, (devices, shape[0] // devices)
                            + shape[1:]), start, size, axis=1)
            return jnp.reshape(blocks, (devices * size,) + shape[1:])
        return keras.tree.map_structure(of, data)

    def scanned_micro_batch(carry, _):
        index, state = carry
        _, new_state = train_step(
            model, state, rows(index * micro_batch_size, micro_batch_size),
            counts=index == 0, may_end=False)
        new_state = jax.tree.map(
            lambda new, old: jnp.asarray(new, jnp.result_type(old)),
            new_state, state)
        return (index + 1, new_state), None

    accumulation.micro_batches_in_step = len(bounds)
    try:
        if scanned:
            (_, state), _ = jax.lax.scan(scanned_micro_batch, (0, state),
                                         length=scanned)
        start, stop = bounds[-1]
        return train_step(model, state, rows(start, stop - start),
                          counts=not scanned)
    finally:
        accumulation.micro_batches_in_step = 1


def memory_limit(settings):
    """Int. The bytes `micro_batch_size="auto"` fits a compiled step to:
    `memory_limit`, or nine tenths of what the device's allocator may hold
    (the rest for what lives outside the step).

    Raises:
        ValueError: Neither is known (a CPU reports no memory).
    """
    if settings.memory_limit is not None:
        return settings.memory_limit
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(
            "micro_batch_size=\"auto\" on JAX fits the compiled step to the "
            f"device's memory, which this device ({device.platform}) does "
            "not report: give the bytes a step may hold, as "
            "memory_limit=<bytes>, or an integer micro_batch_size. "
            "Received: micro_batch_size=\"auto\", memory_limit=None")
    return int(stats["bytes_limit"] * 0.9)


def step_bytes(model, state, data, micro_batch_size):
    """Int. The bytes one device holds in the step on batches shaped as
    `data` split into micro-batches of `micro_batch_size` (the compiled
    step's arguments, temporaries and outputs not written over its
    arguments, by XLA's `memory_analysis`)."""
    def abstract(value, sharding=None):
        return jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value),
                                    sharding=sharding)

    state = jax.tree.map(abstract, state)
    data = jax.tree.map(abstract, data)
    blocks = model._accumulation.blocks
    window_sharding = model._accumulation.window_sharding
    if blocks is not None and window_sharding is not None:
        # Laid out as `DataParallel` lays the step's state and batch out
        # (every variable replicated, the window in blocks, the batch
        # split), so that the account is one device's.
        replicated = jax.sharding.NamedSharding(
            blocks.mesh, jax.sharding.PartitionSpec())
        *values, window = state[2]
        state = jax.tree.map(lambda value: abstract(value, replicated),
                             (state[0], state[1], values, state[3]))
        state = (state[0], state[1], state[2] + [jax.tree.map(
            abstract, window, window_sharding)], state[3])
        data = jax.tree.map(lambda value: abstract(value, (
            blocks.sharding if len(value.shape) else replicated)), data)
    compiled = jax.jit(
        functools.partial(micro_batches_step, model,
                          micro_batch_size=micro_batch_size),
        donate_argnums=0).lower(state, data).compile()
    memory = compiled.memory_analysis()
    return (memory.argument_size_in_bytes + memory.temp_size_in_bytes
            + memory.output_size_in_bytes - memory.alias_size_in_bytes)


def train_step(model, state, data, counts=True, may_end=True):
    """One micro step on JAX: pure, `(state, data) -> (logs, state)`.
    (`counts` and `may_end`: see `stateless_window.add_micro_batch`.)"""
    accumulation = model._accumulation
    (trainable, non_trainable, optimizer_and_window,
     metrics_values) = state
    optimizer_values = list(optimizer_and_window[:-1])
    window = optimizer_and_window[-1]
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    accumulation._traced_window = window

    def optimizer_values_in_scope():
        # Loss scaling reads the step's own values of the optimizer's
        # variables (the dynamic scale), as Keras's JAX step does.
        return keras.StatelessScope(state_mapping=list(
            zip(model.optimizer.variables, optimizer_values)))

    def forward(trainable, non_trainable, x, combined_moments=None):
        kwargs = {"training": True} if model._call_has_training_arg else {}
        with accumulation.statistics.recording(
                combined_moments, accumulation.spectral_writes()) as records:
            y_pred, new_non_trainable, layer_losses = model.stateless_call(
                trainable, non_trainable, x, return_losses=True, **kwargs)
        moments = accumulation.statistics.moments_of(records)
        return y_pred, new_non_trainable, layer_losses, moments

    def scaled_loss_of(trainable, outputs):
        y_pred, new_non_trainable, layer_losses, moments = outputs
        if layer_losses:
            model._losses_override.clear()
            model._losses_override = layer_losses
        # This micro-batch's own mean loss; the window divides by its
        # whole weight.
        with losses.losses_not_divided_by_replicas(), \
                losses.recording_loss_reductions(KERAS_SHAPES) as reductions:
            loss, (_, _, new_metrics) = model.stateless_compute_loss(
                trainable, new_non_trainable, metrics_values, x=x, y=y,
                y_pred=y_pred, sample_weight=sample_weight, training=True)
        accumulation.divide_by_weight = micro_step.loss_reduced(
            model, reductions, y_pred, losses.get_keras_mask, KERAS_SHAPES)
        # Read while `model.losses` still holds this pass's added losses.
        weight = jnp.asarray(
            model.micro_batch_weight(x, y, y_pred, sample_weight),
            jnp.float32)
        if layer_losses:
            model._losses_override.clear()
        with optimizer_values_in_scope():
            scaled_loss = model.get_scaled_loss(loss)
        return scaled_loss, (
            loss, y_pred, new_non_trainable, new_metrics, weight, moments)

    gradients = per_device_gradients(model, trainable, non_trainable, x,
                                     forward, scaled_loss_of)
    if gradients is None:
        (_, aux), gradients = jax.value_and_grad(
            lambda trainable: scaled_loss_of(
                trainable, forward(trainable, non_trainable, x)),
            has_aux=True)(trainable)
        gradients = [accumulation.spread(g) for g in gradients]
    else:
        gradients, aux = gradients
    loss, y_pred, new_non_trainable, metrics_values, weight, moments = aux
    # The window moves the pooled layers' statistics when it ends.
    non_trainable = accumulation.statistics.keep_moving(new_non_trainable,
                                                        non_trainable)
    with optimizer_values_in_scope():
        gradients = model.get_unscaled_gradients(gradients)

    samples = jnp.asarray(divisor.batch_size(x, KERAS_SHAPES), jnp.float32)
    (trainable, non_trainable, optimizer_values, window, ends, window_loss,
     window_samples) = stateless_window.add_micro_batch(
        accumulation, list(trainable), optimizer_values, window, gradients,
        weight, loss, samples, non_trainable, moments, counts, may_end)

    # The loss in the logs is each window's, logged when it ends, weighted
    # by its samples as Keras weighs a batch's.
    with keras.StatelessScope(state_mapping=list(
            zip(model.metrics_variables, metrics_values))) as scope:
        if ends is not False:
            model._loss_tracker.update_state(
                window_loss,
                sample_weight=jnp.where(ends, window_samples, 0.0))
        logs = model.compute_metrics(x, y, y_pred, sample_weight)
        if "loss" in logs:
            # Until a window ends in the epoch the tracker is empty: the
            # logs read the open window's loss so far instead of 0.
            so_far = arithmetic.window_loss(
                window.loss_sum, window.weight_sum,
                accumulation.divide_by_weight, KERAS_OPS)
            logs = {**logs, "loss": jnp.where(
                _current(scope, model._loss_tracker.count) > 0,
                logs["loss"], so_far)}
    metrics_values = [
        _current(scope, variable) for variable in model.metrics_variables]
    accumulation._traced_window = None
    logs = micro_step.logged(logs, lambda: window.skipped_windows,
                             accumulation.loss_scaling.active,
                             accumulation.settings)
    enforce = getattr(model, "_enforce_jax_state_sharding", None)
    if enforce is not None and accumulation.window_sharding is not None:
        # keras before 3.11 (checked on 3.10.0) jits the step without
        # out_shardings; its own step constrains the state's layout instead.
        trainable, non_trainable, optimizer_values, metrics_values = enforce(
            list(trainable), list(non_trainable), list(optimizer_values),
            list(metrics_values))
        window = jax.lax.with_sharding_constraint(
            window, accumulation.window_sharding)
    return logs, (trainable, non_trainable,
                  optimizer_values + [window], metrics_values)


def per_device_gradients(model, trainable, non_trainable, x, forward,
                         loss_of):
    """Each device's share of the micro-batch's gradient, unreduced, under
    `DataParallel` (one block per device, see `jax_window.DeviceBlocks`),
    with `loss_of`'s auxiliary values; None where the step reduces the
    gradient as Keras's own does.

    Every device runs the forward pass on its own shard with its own copy
    of the weights (`shard_map`); the loss, its divisor and the metrics are
    computed over the whole micro-batch's predictions as Keras computes
    them; and its gradient with respect to the predictions goes back
    through each device's own pass to that device's copy. The blocks sum
    to the whole batch's gradient, so the only gradient-sized reduction is
    the window end's. Where samples meet in the pass:

    - a pooled `BatchNormalization` normalizes by the whole micro-batch's
      moments, combined from each device's (`whole_batch_moments`, a
      reduction the size of its channels, and one in the backward pass);
    - a random layer draws each device's share from its own stream (its
      seed mixed with the device's index, `device_stream`), and its seed
      moves on as in Keras's step;
    - each device's share of an additive activity penalty is added up to
      the whole batch's (`additive_activity_penalties`).

    Where the pass writes any other variable, draws from a fixed integer
    seed, adds any other loss, or the batch does not split evenly over the
    devices, the step reduces the gradient as Keras's does and adds it to
    the first device's block.
    """
    blocks = model._accumulation.blocks
    if blocks is None or any(
            jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % blocks.count
            for leaf in jax.tree.leaves(x)):
        return None
    spec = jax.sharding.PartitionSpec(blocks.axis)
    unvarying = jax.sharding.PartitionSpec()
    position = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
    streams = {position[id(generator.state)]
               for layer in class_tree.layers_of(model)
               for generator in getattr(layer, "_seed_generators", ())
               if id(generator.state) in position}
    moving = model._accumulation.statistics.moving_positions
    separate = {"writes": False, "added_losses": 0, "other_losses": False}

    def own_forward(copies, non_trainable_values, x_shard):
        own = [copy[0] for copy in copies]
        device = jax.lax.axis_index(blocks.axis)
        values = [device_stream(value, device) if index in streams
                  else value
                  for index, value in enumerate(non_trainable_values)]
        with fixed_seed_draws() as fixed_seeds, \
                additive_activity_penalties(model) as penalties:
            y_pred, new_values, layer_losses, moments = forward(
                own, values, x_shard, whole_batch_moments(blocks.axis))
        written = {index for index, (new, old) in enumerate(
            zip(new_values, values)) if new is not old}
        # A draw from a fixed seed would repeat on every device's share.
        separate["writes"] = bool(written - streams - moving or fixed_seeds)
        # Keras lists the losses of the weights' regularizers last; any
        # before them were added in the pass. Each device's share of an
        # additive activity penalty adds up to the whole batch's; any other
        # loss added in the pass is known only as a number.
        added = len(layer_losses) - sum(
            getattr(v, "regularizer", None) is not None
            for v in model.trainable_weights)
        separate["added_losses"] = added
        separate["other_losses"] = added != len(penalties)
        # The loss reads the masks the layers attached to the predictions;
        # the first device's written values are those of Keras's step (its
        # stream is the seed's own), and the moments are every device's.
        masks = jax.tree.map(losses.get_keras_mask, y_pred)
        kept = {index: new_values[index][None] for index in written}
        return ((y_pred, [jnp.reshape(value, (1,))
                          for value in layer_losses]),
                (masks, kept, jax.tree.map(jnp.asarray, moments)))

    def forward_on_copies(copies):
        return jax.shard_map(
            own_forward, mesh=blocks.mesh,
            in_specs=(spec, unvarying, spec),
            out_specs=((spec, spec), (spec, spec, unvarying)),
            # A layer's scan (an LSTM's) starts from a state made in the
            # pass, which JAX's check would count as the same on every
            # device; the gradients taken are the copies' only, and the
            # moments are made the same on every device.
            check_vma=False)(
            copies, list(non_trainable), x)

    copies = [jax.lax.with_sharding_constraint(
        jnp.broadcast_to(value[None], (blocks.count,) + value.shape),
        blocks.sharding) for value in trainable]
    (y_pred, layer_losses), pull_back, (masks, kept, moments) = jax.vjp(
        forward_on_copies, copies, has_aux=True)
    if separate["writes"] or separate["other_losses"]:
        return None
    # Keras divides an activity penalty by the batch (the device's share of
    # it here), or sums it over the batch.
    whole_penalty = (jnp.mean if model._accumulation.penalty_is_a_mean
                     else jnp.sum)
    added = separate["added_losses"]
    new_non_trainable = list(non_trainable)
    for index, values in kept.items():
        new_non_trainable[index] = values[0]

    def loss_of_predictions(outputs, trainable):
        y_pred, layer_losses = outputs
        jax.tree.map(losses.set_keras_mask, y_pred, masks)
        # Each device's copy holds the same weights, so a weight's loss is
        # taken from the first.
        return loss_of(trainable, (
            y_pred, new_non_trainable,
            [whole_penalty(value) if index < added else value[0]
             for index, value in enumerate(layer_losses)],
            moments))

    # A loss may read weights itself (a penalty on a kernel, a learnable
    # temperature): that part of its gradient is the whole batch's, and
    # goes into the first device's block (zeros, which XLA folds away,
    # where it reads none).
    (_, aux), (cotangents, direct) = jax.value_and_grad(
        loss_of_predictions, argnums=(0, 1), has_aux=True)(
            (y_pred, layer_losses), list(trainable))
    (gradients,) = pull_back(cotangents)
    return [block.at[0].add(own) for block, own in zip(gradients, direct)], aux


# Activity regularizers whose penalty is a sum over the elements, so that
# each device's share adds up to the whole batch's.
_ADDITIVE = (keras.regularizers.L1, keras.regularizers.L2,
             keras.regularizers.L1L2)


@contextlib.contextmanager
def additive_activity_penalties(model):
    """Counts the penalties of Keras's additive activity regularizers (L1,
    L2, L1L2, of a batch's outputs) that a pass adds to its layers'
    losses. Yields the list each is appended to."""
    layers = [layer for layer in class_tree.layers_of(model)
              if type(getattr(layer, "activity_regularizer", None))
              in _ADDITIVE]
    penalties = []

    def counting(regularizer):
        def penalty(output):
            value = regularizer(output)
            if jnp.ndim(output) > 0:
                penalties.append(value)
            return value
        return penalty

    originals = [layer.activity_regularizer for layer in layers]
    for layer, regularizer in zip(layers, originals):
        vars(layer)["activity_regularizer"] = counting(regularizer)
    try:
        yield penalties
    finally:
        for layer, regularizer in zip(layers, originals):
            vars(layer)["activity_regularizer"] = regularizer


@contextlib.contextmanager
def fixed_seed_draws():
    """Records the integer seeds random ops draw from in a pass (Keras's
    `draw_seed`, which its JAX random ops call by the name they imported,
    private `keras.src.backend.jax.random.draw_seed`; keras 3.10.0 and
    3.15.1). Yields the list they are appended to."""
    original = jax_random.draw_seed
    seeds = []

    def recording(seed):
        if isinstance(seed, int):
            seeds.append(seed)
        return original(seed)

    jax_random.draw_seed = recording
    try:
        yield seeds
    finally:
        jax_random.draw_seed = original


def device_stream(seed_state, device):
    """A random layer's seed state (Keras's `SeedGenerator`: `[seed,
    counter]`, uint32) as `device` draws from it: the first device's is
    the seed's own, every other's seed is mixed with its index."""
    mixed = seed_state.at[0].set(
        seed_state[0] ^ (jnp.asarray(device, seed_state.dtype)
                         * jnp.asarray(0x9E3779B9, seed_state.dtype)))
    return jnp.where(device == 0, seed_state, mixed)


def whole_batch_moments(axis):
    """A function that makes a BatchNormalization call's moments over one
    device's share of the batch, `(count, mean, variance)` per channel,
    the whole batch's across the devices of `axis` (in a `shard_map`)."""

    def combined(count, mean, variance):
        total, whole_mean, whole_variance = arithmetic.moments_of_parts(
            count, mean, variance, lambda x: jax.lax.psum(x, axis),
            KERAS_OPS)
        return (total, whole_mean.astype(mean.dtype),
                whole_variance.astype(mean.dtype))

    return combined


def _train_step_of(model, state, data):
    return type(model).train_step(model, state, data)


def _current(scope, variable):
    value = scope.get_current_value(variable)
    return variable.value if value is None else value


class JaxModelDifferences:
    """What the Keras 3 `AccumulatingModel` does on JAX: its window rides
    in Keras's JAX state."""

    def make_train_function(self, force=False):
        accumulation = self._accumulation
        if not (force or self.train_function is None):
            return super().make_train_function(force)
        if accumulation.accumulates:
            # The model and its optimizer are built by now (Keras builds
            # them symbolically before it makes the train function).
            accumulation.build_window(self)
        # Keras jits the bound method `self.train_step`, and JAX reuses the
        # trace of an equal bound method while an earlier jit of it lives
        # (a reference cycle keeps the last train function alive): a step
        # made anew, because what it traces changed (a learning-rate
        # schedule, the settings), would run the stale trace. Keras reads
        # the attribute once, here: a function of its own is traced anew.
        self.__dict__["train_step"] = functools.partial(
            _train_step_of, self)
        try:
            return super().make_train_function(force)
        finally:
            del self.__dict__["train_step"]

    def _get_jax_state(self, trainable_variables=False,
                       non_trainable_variables=False,
                       optimizer_variables=False, metrics_variables=False,
                       purge_model_variables=False):
        window = self._accumulation.window
        window_sharding = None
        if (window is not None
                and keras.distribution.distribution() is not None):
            # Read before Keras purges the variables' values.
            window_sharding = _window_sharding(window, (
                v.value.sharding for v in self.trainable_variables),
                self._accumulation.blocks)
        self._accumulation.window_sharding = window_sharding
        state = super()._get_jax_state(
            trainable_variables=trainable_variables,
            non_trainable_variables=non_trainable_variables,
            optimizer_variables=optimizer_variables,
            metrics_variables=metrics_variables,
            purge_model_variables=purge_model_variables,
        )
        if (optimizer_variables and self._accumulation.accumulates
                and window is not None):
            index = int(trainable_variables) + int(non_trainable_variables)
            window_state = window.state
            if window_sharding is not None:
                # Laid out as the step returns it: Keras donates the state,
                # and XLA aliases an input only to an output of its layout.
                window_state = jax.device_put(window_state, window_sharding)
            state = list(state)
            state[index] = list(state[index]) + [window_state]
            state = tuple(state)
        return state

    def _get_state_sharding_spec(self):
        # Under `keras.distribution` Keras jits the step with the state's
        # shardings as `out_shardings`: the window's follow the variables'.
        shardings = super()._get_state_sharding_spec()
        window = self._accumulation.window
        if not (self._accumulation.accumulates and window is not None
                and self.optimizer is not None):
            return shardings
        trainable, non_trainable, optimizer, metrics = shardings
        return (trainable, non_trainable,
                list(optimizer) + [_window_sharding(
                    window, trainable, self._accumulation.blocks)], metrics)

    def jax_state_sync(self):
        jax_state = getattr(self, "_jax_state", None)
        window = self._accumulation.window
        if jax_state and not self._jax_state_synced and window is not None:
            values = jax_state.get("optimizer_variables") or []
            if len(values) == len(self.optimizer.variables) + 1:
                # Keras's attribute tracking wraps the lists it is handed
                # (`_jax_state`): JAX takes plain ones.
                state = values[-1]
                window.state = state._replace(
                    gradient_sums=list(state.gradient_sums),
                    statistics_sums=list(state.statistics_sums))
        super().jax_state_sync()


class JaxAdapter(StatelessAdapter):
    """Keras 3 on JAX: the window inside Keras's jitted step."""

    Accumulation = JaxAccumulation
    ModelDifferences = JaxModelDifferences
    STEP_LOGS_LOSS_BEFORE_A_WINDOW_ENDS = True

    @staticmethod
    def accumulating_train_step(model, state, data):
        if model._accumulation.settings.micro_batch_size is not None:
            return micro_batches_step(model, state, data)
        return train_step(model, state, data)

    @staticmethod
    def choose_micro_batch_size(model, fit_arguments):
        """Refuses "auto" where no memory is known to fit the step to,
        before training; the step chooses for each shape of batch."""
        del fit_arguments
        memory_limit(model._accumulation.settings)

    @staticmethod
    def check_strategy(model):
        """Refuses a `keras.distribution` other than Keras's data and model
        parallelism."""
        del model
        distribution = keras.distribution.distribution()
        if distribution is None or isinstance(distribution, (
                keras.distribution.DataParallel,
                keras.distribution.ModelParallel)):
            return
        raise ValueError(
            "AccumulatingModel trains on JAX on one device or under "
            "keras.distribution.DataParallel or ModelParallel; "
            f"{type(distribution).__name__} is not supported. Use one of "
            "those, or train on one device "
            "(keras.distribution.set_distribution(None))."
            f" Received: distribution={type(distribution).__name__}")

    @staticmethod
    def batch_split_ways():
        """Int. How many equal parts `keras.distribution` cuts each batch
        that `fit()` is given into: the devices along its batch axis (1
        without a distribution) that this process feeds. With several
        processes each hands `fit()` its own share of the batch, cut over
        its own devices."""
        distribution = keras.distribution.distribution()
        if distribution is None:
            return 1
        mesh = distribution.device_mesh
        ways = int(dict(zip(mesh.axis_names, mesh.shape)).get(
            distribution.batch_dim_name, 1))
        return max(1, ways // jax.process_count())

    @staticmethod
    def stateless_accumulate_gradients(model, optimizer_variables, gradients,
                                       trainable_variables, weight):
        """`AccumulatingModel.stateless_accumulate_gradients` (JAX, traced)."""
        accumulation = model._accumulation
        optimizer_variables = list(optimizer_variables)
        window = optimizer_variables[-1] if optimizer_variables else None
        if not isinstance(window, WindowState):
            raise ValueError(
                "`optimizer_variables` must be the optimizer values of the "
                "`state` your `train_step(self, state, data)` received, "
                "whole: the window rides last among them. Received: "
                f"{len(optimizer_variables)} values, the last of type "
                f"{type(window).__name__}")
        gradients = list(gradients)
        if len(gradients) != len(window.gradient_sums):
            raise ValueError(
                f"`gradients` needs one entry per trainable variable "
                f"({len(window.gradient_sums)}). Received: {len(gradients)}")
        accumulation.divide_by_weight = True
        weight = jnp.asarray(weight, jnp.float32)
        gradients = [accumulation.spread(g) for g in gradients]
        trainable, _, optimizer_values, window, *_ = (
            stateless_window.add_micro_batch(
                accumulation, list(trainable_variables),
                optimizer_variables[:-1], window, gradients, weight,
                jnp.asarray(0.0, jnp.float32), weight))
        return trainable, optimizer_values + [window]
