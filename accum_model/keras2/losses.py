"""Keras 2's losses: what a micro-batch's loss is divided by, and its log.

`compile_utils.LossesContainer` divides each loss by the replicas
(`losses_utils.scale_loss_for_distribution`), and `losses.Loss.__call__`
divides a masked loss by its valid elements (`losses_utils.apply_valid_mask`,
then `compute_weighted_loss`). Checked on tf_keras 2.21.0 / TF 2.21.0, keras
2.15.0 / TF 2.15.1 and keras 2.13.1 / TF 2.13.1.
"""

import contextlib

from accum_model.core import divisor
from accum_model.core.patch import identity
from accum_model.core.patch import replaced
from accum_model.keras2.package import src

_losses_utils = src("utils.losses_utils")

# Reductions whose batch loss is one number a window can reproduce.
LOSS_REDUCTIONS = ("auto", "sum_over_batch_size", "sum")

__all__ = ["LOSS_REDUCTIONS", "compute_loss", "get_keras_mask",
           "logged_loss", "losses_not_divided_by_replicas",
           "recording_loss_reductions", "track_loss"]


def compute_loss(model, **arguments):
    return model.compute_loss(**arguments)


def get_keras_mask(tensor):
    return getattr(tensor, "_keras_mask", None)


def track_loss(model, loss, batch_size):
    """Nothing to do: Keras 2's compiled loss updates the "loss" it reports
    in every micro step (`LossesContainer._loss_metric`)."""
    del model, loss, batch_size


def logged_loss(model):
    """None: Keras 2's logged loss is its compiled loss's, already final."""
    del model


def losses_not_divided_by_replicas():
    """While tracing a loss, keeps Keras 2 from dividing it by the replicas.

    `LossesContainer.__call__` divides each mean loss, and the sum of the
    regularization losses, by the number of replicas through
    `losses_utils.scale_loss_for_distribution`; made the identity, every
    loss is this replica's own mean.
    """
    return replaced(_losses_utils,
                    {"scale_loss_for_distribution": identity})


@contextlib.contextmanager
def recording_loss_reductions():
    """Records how Keras 2 reduces each loss computed inside the context.

    `losses.Loss.__call__` merges the prediction's mask with the loss's,
    hands it to `losses_utils.apply_valid_mask` (which reweights the valid
    elements so that the mean divides by their number) and reduces with
    `losses_utils.compute_weighted_loss`. Both are wrapped; the returned
    list receives one `divisor.Reduction` per loss term.
    """
    records = []
    masks = []
    apply_valid_mask = _losses_utils.apply_valid_mask
    compute_weighted_loss = _losses_utils.compute_weighted_loss

    def noting_mask(losses, sample_weight, mask, reduction):
        masks.append(mask)
        return apply_valid_mask(losses, sample_weight, mask, reduction)

    def recording(losses, sample_weight=None, reduction="sum_over_batch_size",
                  name=None):
        loss = compute_weighted_loss(losses, sample_weight,
                                     reduction=reduction, name=name)
        mask = masks.pop() if masks else None
        if reduction not in (None, "none", divisor.SUM):
            reduction = "sum_over_batch_size"  # What "auto" means here.
        records.append(divisor.reduction_of(losses, reduction, mask))
        return loss

    with replaced(_losses_utils, {"apply_valid_mask": noting_mask,
                                  "compute_weighted_loss": recording}):
        yield records
