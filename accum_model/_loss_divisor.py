"""What Keras divides a micro-batch's loss by."""

import tensorflow as tf
from keras import tree

from accum_model import _keras_private


def batch_size(x):
    """The number of samples in a batch of inputs `x`, as an int32 tensor."""
    first_input = next(i for i in tree.flatten(x) if i is not None)
    return tf.shape(first_input)[0]


def loss_divisor(x, y_pred):
    """Returns the number of loss elements Keras averages a batch loss over.

    With the default `sum_over_batch_size` reduction, Keras divides the
    summed (sample-weighted) loss by the number of loss elements, or by the
    number of valid elements when the prediction carries a Keras mask. Sample
    weights never change the divisor. Losses reduce the last axis of the
    prediction, so an element is one position of `y_pred.shape[:-1]`.

    The first output decides: every output of an unmasked model has the
    same ratio between micro-batch and window divisors, so any one of them
    weights the window exactly. Several outputs with different masks cannot
    be weighted by one number; override `micro_batch_weight` for those.

    Args:
        x: The micro-batch inputs.
        y_pred: The model's predictions for them.

    Returns:
        A float32 scalar tensor.
    """
    outputs = [o for o in tree.flatten(y_pred) if o is not None]
    if not outputs:
        return tf.cast(batch_size(x), tf.float32)
    output = outputs[0]
    mask = _keras_private.get_keras_mask(output)
    if mask is not None:
        return tf.reduce_sum(tf.cast(mask, tf.float32))
    shape = tf.shape(output)
    if output.shape.rank is not None and output.shape.rank <= 1:
        return tf.cast(shape[0], tf.float32)
    return tf.cast(tf.reduce_prod(shape[:-1]), tf.float32)
