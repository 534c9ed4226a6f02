"""What the model layer asks of Keras and its backend: the `Adapter` base.

The public model, its checks and its callbacks are written once, against
one `Adapter`. Each Keras and backend has a subclass, picked once by
`accum_model._chooser` as Keras picks its trainer:
`keras3.tensorflow_adapter.TensorFlowAdapter`,
`keras3.jax_adapter.JaxAdapter` and `keras3.torch_adapter.TorchAdapter`
(the last two through `keras3.stateless_adapter.StatelessAdapter`, all
three through `keras3.adapter.Keras3Adapter`), and
`keras2.adapter.Keras2Adapter`. The defaults here hold for a loop that runs
one program per step and stops before a step when the data runs out.

A subclass also gives:

* `keras`, the Keras package that trains; `Functional`, its functional
  model class; `LOSS_REDUCTIONS`, the loss reductions it knows.
* Its parts (`PARTS`): the Keras's own modules by concern, `losses`,
  `saving`, `learning_rate`, `loop` and `optimizer`, each holding the
  functions `PARTS` names; the layers above call them through the part
  (`adapter.saving.serialize_as(...)`).
* The window's classes: `Accumulation` (the model holds one),
  `LossScaling` (a `LossScaleOptimizer` taken apart for windows),
  `ModelDifferences` (mixed into the model class) and `WindowCheckpoint`.
* The step: `accumulating_train_step`, `default_micro_batch_weight`,
  `accumulate_gradients` (a stateful step) or
  `stateless_accumulate_gradients` (a stateless one; the base refuses
  the hook the step does not use), `check_strategy`.
* Values: `value_of_call(function, array)`, a function of a NumPy array
  as the backend's tensor, as a float.
"""

class Adapter:
    """The answers most stacks share; see the module's docstring."""

    # The functions each part (a module of the Keras in use) holds.
    PARTS = {
        "losses": ("activity_penalty_is_a_mean", "compute_loss",
                   "get_keras_mask", "logged_loss_totals",
                   "loss_logged_by_window", "losses_not_divided_by_replicas",
                   "track_loss", "tracker_weighing_all_samples"),
        "saving": ("clones_through_constructor",
                   "functional_constructor_signature", "register_plain_name",
                   "serialize_as", "unsafe_deserialization",
                   "compiled_state_hidden", "wrap_sequential_cloning"),
        "learning_rate": ("learning_rate_of", "scalable_learning_rate"),
        "loop": ("micro_steps_in_epoch", "model_keyword_arguments",
                 "steps_per_execution"),
        "optimizer": ("check_optimizer", "float16_gradient_flags"),
    }
    # Each set by a subclass to its Keras's module of that name.
    losses = saving = learning_rate = loop = optimizer = None

    # What a run of the train function raises when the data has run out.
    END_OF_DATA_ERRORS = ()
    # Why `steps_per_execution > 1` is refused, or "" where it is safe.
    STEPS_PER_EXECUTION_FIX = ""
    # Where plain Keras treats a row that repeats in an `Embedding`'s
    # sparse gradient (TensorFlow's `IndexedSlices`) one occurrence at a
    # time: "optimizer" (Adam, RMSprop, ... apply each in turn), "clipping"
    # (`clipvalue` clips each, `clipnorm` and `global_clipnorm` count each
    # in the norm). The window takes the gradient whole.
    SPARSE_ROW_STRAYS = frozenset()
    # Whether the step itself logs the open window's loss while Keras's
    # loss tracker is empty (the model's state cannot be read mid-epoch),
    # or the window callback writes it into the batch's logs.
    STEP_LOGS_LOSS_BEFORE_A_WINDOW_ENDS = False
    # Whether Keras's evaluation logs a loss reduced with "sum" times the
    # replicas under a strategy (its loss tracker weighs each replica's
    # share by its samples).
    SUMS_LOGGED_PER_REPLICA = False

    @staticmethod
    def executions_stop_cleanly_at_end_of_data():
        """Whether an execution of several steps stops between two steps
        when the data runs out."""
        return True

    @staticmethod
    def replicas_in_sync(model):
        """Int. Replicas whose windows meet at the window end."""
        del model
        return 1

    @staticmethod
    def batch_split_ways():
        """Int. How many equal parts each batch must split into across
        devices."""
        return 1

    @staticmethod
    def choose_micro_batch_size(model, fit_arguments):
        """Before `fit()` trains (`fit_arguments`: its arguments by name),
        under `micro_batch_size="auto"`: chooses the size where the step
        cannot (TensorFlow's traced step), or refuses what cannot choose
        one. By default the step chooses it for each shape of batch."""
        del model, fit_arguments

    @staticmethod
    def evaluating_like_one_device(model, test_function):
        """`model`'s `test_function`, with its losses reduced as one device
        reduces the whole batch."""
        del model
        return test_function

    @staticmethod
    def pools_moving_statistics(layer):
        """Whether a window takes over `layer`'s moving statistics."""
        del layer
        return False

    @staticmethod
    def writes_variables_per_micro_batch(layer, own_step):
        """Whether `layer` is one of this Keras's own that writes variables
        in each training call, where the window does not take that over
        (`own_step`: the model trains with a step of the user's own, whose
        forward pass the window does not see)."""
        del layer, own_step
        return False

    @staticmethod
    def foreign_variables_in_graph(model):
        """Names of the graph's layers that hold another Keras's variables."""
        del model
        return []

    @staticmethod
    def compile_arguments(model):
        """The keyword arguments `model.compile` was last called with, or
        None before it was. Both Kerases keep them in the private
        `_compile_config.config` (checked on keras 3.6.0-3.15.1 and Keras 2
        on TensorFlow 2.13.1 and tf_keras 2.21.0)."""
        return getattr(getattr(model, "_compile_config", None), "config",
                       None)

    @staticmethod
    def accumulate_gradients(model, gradients, weight, batch_size=None):
        """`AccumulatingModel.accumulate_gradients`, where the step is
        stateful; a stateless step (JAX's) is told what it calls instead."""
        del model, gradients, weight, batch_size
        raise NotImplementedError(
            "`accumulate_gradients` hands gradients to a stateful window; "
            "on JAX a training step of your own, `train_step(self, state, "
            "data)`, is stateless: call `trainable_variables, "
            "optimizer_variables = self.stateless_accumulate_gradients("
            "optimizer_variables, gradients, trainable_variables, weight)` "
            "where Keras's step calls `self.optimizer.stateless_apply`.")

    @staticmethod
    def stateless_accumulate_gradients(model, optimizer_variables,
                                       gradients, trainable_variables,
                                       weight):
        """`AccumulatingModel.stateless_accumulate_gradients`, where the
        step is stateless (JAX's); a stateful step is told what it calls
        instead."""
        del model, optimizer_variables, gradients, trainable_variables
        del weight
        raise NotImplementedError(
            "`stateless_accumulate_gradients` is for a stateless "
            "`train_step(self, state, data)` on Keras 3's JAX backend; on "
            "this backend the step is stateful: call "
            "`self.accumulate_gradients(gradients, weight)` where Keras's "
            "step calls `self.optimizer.apply`.")

    @staticmethod
    def is_foreign_layer(value):
        """Whether `value` is a layer of another Keras, whose weights this
        one does not see."""
        del value
        return False
