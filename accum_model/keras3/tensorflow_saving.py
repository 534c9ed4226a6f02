"""The open window in Keras 3 files and TensorFlow checkpoints.

Checked on keras 3.6.0 / TF 2.16.2, 3.10.0 / TF 2.18.1 and 3.15.1 /
TF 2.21.0 (the tests that exercise it pass, `.ci/matrix`).
"""

from keras.src.saving.keras_saveable import KerasSaveable

from accum_model.tensorflow import checkpoint

class Keras3TensorFlowWindowCheckpoint(
        KerasSaveable, checkpoint.TensorFlowWindowCheckpoint):
    """The open window, in Keras files and in TensorFlow checkpoints.

    Keras files (`save_weights`, `.keras`, `ModelCheckpoint`,
    `BackupAndRestore`): `saving_lib._walk_saveable` visits every attribute
    of the model that is a `KerasSaveable`, private ones last, and calls its
    `save_own_variables` / `load_own_variables` with an entry of its own;
    a file without that entry gives an empty one, and a model without the
    attribute never asks for it (a plain `keras.Model` loads such a file).
    Keras files store nothing while no window exists, so they stay what a
    plain model would write. TensorFlow checkpoints: see the core class.

    Args:
        accumulation: The `Accumulation` whose window is saved.
    """

    def _obj_type(self):
        # Which of Keras's attribute skip-sets applies when the saver walks
        # this object; it holds no Keras objects of its own.
        return "Layer"

    def save_own_variables(self, store):
        if self.has_state():
            for key, value in self.with_sizer_state(
                    self.saved_state()).items():
                store[key] = value

    def load_own_variables(self, store):
        self.restore_state({key: store[key] for key in store.keys()})
