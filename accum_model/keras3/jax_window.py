"""Keras 3 on JAX: what only JAX's window has.

The window itself is `stateless_window`'s, run inside Keras's jitted step
(see `jax_training`). Here: its layout under `keras.distribution`, the
jitted end of a window left open at an epoch's end, 64-bit accumulators
only in JAX's 64-bit mode, and the update signal read from Keras's JAX
state. Checked on keras 3.10.0 and 3.15.1 with jax 0.10.2.
"""

import jax
import jax.numpy as jnp

from accum_model.keras3 import stateless_window


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


def window_sharding(window, trainable_shardings):
    """The shardings of `window`'s state under `keras.distribution`: each
    gradient sum is laid out as its variable, every counter replicated."""
    trainable_shardings = list(trainable_shardings)
    replicated = _replicated_like(
        trainable_shardings[0] if trainable_shardings else None)
    return jax.tree.map(lambda _: replicated, window.state)._replace(
        gradient_sums=[
            sharding if total.ndim else replicated
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

