"""Keras 3 on JAX: what only JAX's window has.

The window itself is `stateless_window`'s, run inside Keras's jitted step
(see `jax_adapter`). Here: its layout under `keras.distribution`, the
jitted end of a window left open at an epoch's end, 64-bit accumulators
only in JAX's 64-bit mode, and the update signal read from Keras's JAX
state. Checked on keras 3.10.0 and 3.15.1 with jax 0.10.2.

Under `keras.distribution.DataParallel` over several devices each gradient
sum has one block per device along the batch axis (`DeviceBlocks`): a micro
step adds each device's share of its gradient to that device's block, and
the window end sums the blocks, the one reduction of a window's gradient.
"""

import typing

import jax
import jax.numpy as jnp
import keras
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from accum_model.core import class_tree
from accum_model.core import window as core_window
from accum_model.core.variables import is_overwritten_with_gradient
from accum_model.keras3 import losses
from accum_model.keras3 import stateless_window
from accum_model.keras3.normalization import pools_moving_statistics


class DeviceBlocks(typing.NamedTuple):
    """The devices a `DataParallel` batch is split over: each holds one
    block of every gradient sum."""

    mesh: jax.sharding.Mesh
    axis: str
    count: int

    @property
    def sharding(self):
        """One block on each device of the batch axis."""
        return NamedSharding(self.mesh, PartitionSpec(self.axis))


def batch_devices():
    """Int. The devices a batch is split over (`DataParallel`'s batch
    axis), or 1."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.DataParallel):
        return 1
    mesh = distribution.device_mesh
    return int(dict(zip(mesh.axis_names, mesh.shape)).get(
        distribution.batch_dim_name, 1))


def device_blocks():
    """The `DeviceBlocks` of the current `keras.distribution`, or None
    where the window keeps one sum per variable: on one device, or under
    `ModelParallel`, whose variables are laid out by its own map."""
    count = batch_devices()
    if count < 2:
        return None
    distribution = keras.distribution.distribution()
    return DeviceBlocks(distribution.device_mesh.backend_mesh,
                        distribution.batch_dim_name, count)


class JaxAccumulation(stateless_window.StatelessAccumulation):
    """`stateless_window.StatelessAccumulation` on JAX.

    Args:
        settings: The `Settings` to accumulate with.
    """

    def __init__(self, settings):
        super().__init__(settings)
        self.update_signal = JaxUpdateSignal()
        # The window's layout under `keras.distribution` (set as the step's
        # state is gathered), else None.
        self.window_sharding = None
        # XLA runs a conditional on a GPU by copying its predicate to the
        # host and blocking the host until the GPU has done all before it
        # (`ConditionalThunk`, checked with jax 0.11.2): a window end
        # chosen that way in every micro step would stop the host queuing
        # the next steps ahead. There the step computes the window's end
        # and keeps it only where the window ends; a CPU or TPU branches.
        self.selects_outcomes = jax.default_backend() == "gpu"
        # The window's `DeviceBlocks` (settled as it is built), or None.
        self.blocks = None
        # Whether Keras divides an activity penalty by the batch (settled
        # with the blocks).
        self.penalty_is_a_mean = True

    def _check_settings(self, settings):
        if (settings.accumulator_dtype == "float64"
                and not jax.config.jax_enable_x64):
            raise ValueError(
                "`accumulator_dtype='float64'` needs JAX's 64-bit mode: "
                "jax.config.update('jax_enable_x64', True) before building "
                "the model, or accumulator_dtype='float32'. Received: "
                "accumulator_dtype='float64'")

    def _eager_end(self, end):
        return jax.jit(end)

    # SpectralNormalization -------------------------------------------------

    def spectral_writes(self):
        """Keras's JAX step keeps none of a `SpectralNormalization` layer's
        kernel writes (keras 3.15.1: the kernel is renormalized in each
        pass, its variable never), and writes `vector_u`: the kernel is
        renormalized in every micro step from the `vector_u` the window
        started with, which moves as the window closes."""
        return self.closes_window, None

    def closes_window(self):
        """Bool scalar: whether the micro step being run ends its window
        (every micro step on JAX counts: no step runs on an empty batch)."""
        state = self._traced_window
        if state is None:
            return True
        return core_window.ends_with_next(state)

    def apply_open_window(self):
        # A window no micro step closed (an epoch of unknown length ended
        # it) moves `vector_u` as the large batch's step does, once, from
        # the weights the window started with.
        if self.open_micro_steps() and self.statistics is not None:
            for layer in self.statistics.renormalizing:
                # As the layer's call: an all-zero kernel is left alone.
                if bool(keras.ops.any(layer.kernel.value != 0)):
                    layer.vector_u.assign(layer.normalized_weights()[0])
        super().apply_open_window()

    # Per-device blocks ------------------------------------------------------

    @property
    def reduces_at_end(self):
        return self.blocks is not None

    def build_window(self, model):
        # Settled with each new window: Keras lays a model's variables out
        # once, as they are made, and a window that is kept keeps its sums.
        if self.window is None or not self.window.matches(
                model.trainable_variables):
            self.blocks = (device_blocks() if self._samples_apart(model)
                           else None)
            if self.blocks is not None:
                self.penalty_is_a_mean = losses.activity_penalty_is_a_mean()
        super().build_window(model)

    def _samples_apart(self, model):
        """Whether each device's share of a micro-batch's gradient can be
        summed apart from the others' (see `jax_adapter.per_device_gradients`
        for what is settled in the step): not where a BatchNormalization
        layer takes its moments in a way of its own (the pooled ones are
        combined across devices), the noise scale needs each micro-batch's
        whole gradient, float16 sums could overflow apart where the whole
        would not, a variable is overwritten rather than updated, or the
        model computes its loss itself. (A layer of the user's own that
        mixes samples sees each device's share, as under
        `MirroredStrategy`.)"""
        return not (
            any(isinstance(layer, keras.layers.BatchNormalization)
                and layer.trainable and not pools_moving_statistics(layer)
                for layer in class_tree.layers_of(model))
            or self.settings.measure_noise_scale
            or self.settings.may_overflow
            or any(is_overwritten_with_gradient(v)
                   for v in model.trainable_variables)
            or class_tree.overriding_classes(type(model), "compute_loss"))

    def _sum_shape(self, variable):
        shape = tuple(variable.shape)
        return shape if self.blocks is None else (self.blocks.count,) + shape

    def _placed(self, total, like, kept):
        if self.blocks is None:
            return super()._placed(total, like, kept)
        return self.spread(
            jnp.asarray(total.reshape(like.shape[1:]), like.dtype))

    def spread(self, value):
        """`value`, a whole gradient (or sum) of one variable, as blocks
        that sum to it: itself in the first, zeros in the rest. (Blocks are
        kept only where no variable is overwritten, see `_samples_apart`.)"""
        if self.blocks is None:
            return value
        blocks = jnp.concatenate([value[None], jnp.zeros(
            (self.blocks.count - 1,) + value.shape, value.dtype)])
        return jax.lax.with_sharding_constraint(blocks, self.blocks.sharding)

    def with_held_sums(self, state, consume=False):
        del consume
        if self.blocks is None:
            return state
        return state._replace(gradient_sums=[
            jnp.sum(total, axis=0) for total in state.gradient_sums])

    def zero_sums(self):
        # The emptied window's sums keep one block per device (the window
        # end reduced the ones it applied), every one in the accumulator
        # dtype (no variable is overwritten where blocks are kept).
        if self.blocks is None:
            return None
        dtype = self.settings.accumulator_dtype
        return [jax.lax.with_sharding_constraint(
            jnp.zeros(self._sum_shape(variable), dtype), self.blocks.sharding)
            for variable in self.window.trainable_variables]


def window_sharding(window, trainable_shardings, blocks=None):
    """The shardings of `window`'s state under `keras.distribution`: each
    gradient sum is laid out as its variable (or, with `blocks`, one block
    per device), every counter replicated."""
    trainable_shardings = list(trainable_shardings)
    replicated = _replicated_like(
        trainable_shardings[0] if trainable_shardings else None)
    return jax.tree.map(lambda _: replicated, window.state)._replace(
        gradient_sums=[
            blocks.sharding if blocks is not None
            else sharding if total.ndim else replicated
            for sharding, total in zip(trainable_shardings,
                                       window.state.gradient_sums)])


def _replicated_like(sharding):
    """A sharding that keeps a whole copy on each device of `sharding`'s."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec())
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding


class JaxUpdateSignal:
    """Whether the last run of the train function applied an update.

    Copies the optimizer's `iterations` from the state before and after each
    run (the state's own arrays are handed over to the next run). Once
    Keras has written the state back into the variables (a callback's
    `self.model` does; so does an epoch's end, where the open window may
    be applied), the variable itself is the count after.
    """

    def __init__(self):
        self._before = self._after = None
        self._iterations = None

    def watching(self, train_function, optimizer):
        self._iterations = optimizer.iterations
        index = next(i for i, v in enumerate(optimizer.variables)
                     if v is optimizer.iterations)

        def train_function_noting_updates(state, *args):
            optimizer_position = len(state) - 2
            self._before = jnp.array(state[optimizer_position][index])
            logs, state = train_function(state, *args)
            self._after = jnp.array(state[optimizer_position][index])
            return logs, state

        return train_function_noting_updates

    def applied(self):
        if self._before is None:
            return False
        # Keras empties a variable (private `_value`) while the state it
        # trains on lives elsewhere.
        written_back = getattr(self._iterations, "_value", None) is not None
        after = self._iterations.value if written_back else self._after
        return int(after) > int(self._before)

