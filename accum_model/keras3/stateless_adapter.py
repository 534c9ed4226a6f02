"""What Keras 3's JAX and PyTorch trainers share, as a window needs it.

Both loops learn that data ran out before a step (no step raises, none
runs on an empty batch), run on one replica as far as a window can tell
(JAX's `keras.distribution` runs one program over the sharded batch), hold
no Keras 2 layer, and record BatchNormalization's moments through
`stateless_normalization`: the `Adapter` defaults hold. Checked on keras
3.10.0 and 3.15.1 with jax 0.10.2, and keras 3.15.1 with torch 2.13.0.
"""

from accum_model.core import divisor
from accum_model.keras3 import losses
from accum_model.keras3.adapter import Keras3Adapter
from accum_model.keras3.stateless_ops import KERAS_SHAPES
from accum_model.keras3.stateless_window import StatelessLossScaling
from accum_model.keras3.stateless_window import StatelessWindowCheckpoint


class StatelessAdapter(Keras3Adapter):
    """Keras 3 on JAX or PyTorch: the window of `stateless_window`."""

    LossScaling = StatelessLossScaling
    WindowCheckpoint = StatelessWindowCheckpoint

    @staticmethod
    def default_micro_batch_weight(model, x, y_pred):
        """What Keras divided this micro step's loss by (inside the step)."""
        return divisor.default_weight(model, x, y_pred,
                                      losses.get_keras_mask, KERAS_SHAPES)
