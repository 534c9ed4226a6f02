"""State that TensorFlow checkpoints carry, the same under every Keras."""

import tensorflow as tf


class SavedInTfCheckpoints(tf.__internal__.tracking.Trackable):
    """Base of a model attribute whose state TF checkpoints carry.

    `tf.train.Checkpoint` (and Keras 2's `save_weights` in the TensorFlow
    format) follows the model's trackable attributes and calls
    `_serialize_to_tensors` / `_restore_from_tensors`, matching saved
    tensors by the names the object serializes now, so those names must not
    depend on the state. SavedModel export (`model.export`,
    `tf.saved_model.save`) leaves the state out.

    Subclasses implement `has_state()`, `saved_state()` (a dict of arrays,
    always with the same keys) and `restore_state(arrays)`.
    """

    def _serialize_to_tensors(self):
        if not tf.executing_eagerly():
            # SavedModel export traces this in a graph: an exported model
            # serves, it does not resume training, so it carries no state.
            return {}
        return {
            key: tf.convert_to_tensor(value)
            for key, value in self.saved_state().items()
        }

    def _restore_from_tensors(self, restored_tensors):
        if not tf.executing_eagerly():
            return tf.no_op()  # SavedModel export traces this too.
        self.restore_state(
            {key: value.numpy() for key, value in restored_tensors.items()}
        )
        return tf.no_op()
