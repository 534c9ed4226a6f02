"""BatchNormalization's pooled statistics in PyTorch's eager step, in a few
operations for all layers together.

The pooling rule is `stateless_normalization`'s. What differs on PyTorch is
how a stateful forward pass is kept from moving the statistics and how a
micro-batch's moments reach the window's sums:

- During the forward pass each layer's `momentum` is 1.0, so that Keras's
  own update (`moving * momentum + batch * (1 - momentum)`) writes back the
  value it read; a layer called a number of times its graph does not show
  is moved afterwards by Keras's rule, call by call.
- The window's sums are the store's own tensors; a micro-batch's moments
  are added into their rows in place with `torch._foreach_*` calls over
  every layer at once (where every call's element count is a number, as
  without a mask), under `torch.no_grad()`.
Checked on keras 3.15.1 with torch 2.13.0: `BatchNormalization.call` reads
`self.momentum` when it assigns the moving statistics.
"""

import contextlib

import torch
from keras import ops

from accum_model.keras3.stateless_normalization import PooledStatistics
from accum_model.keras3.stateless_normalization import unmasked_count


class TorchPooledStatistics(PooledStatistics):
    """`PooledStatistics` for PyTorch's eager step (see the module).

    Args:
        model: The built model.
    """

    def __init__(self, model):
        super().__init__(model)
        # The sums whose rows `_rows` holds views of, and those views.
        self._rows_of = None
        self._rows = None
        self._records = None

    @contextlib.contextmanager
    def recording(self, combined=None, spectral_writes=None):
        pinned = self.layers
        for layer in pinned:
            vars(layer)["_accum_momentum"] = layer.momentum
            vars(layer)["momentum"] = 1.0
        try:
            with super().recording(combined, spectral_writes) as records:
                self._records = records
                yield records
        finally:
            for layer in pinned:
                vars(layer)["momentum"] = vars(layer).pop("_accum_momentum")

    def element_counts(self, layer, inputs, mask):
        if mask is None:
            # A number, which the in-place sums add without an operation of
            # its own per layer.
            return float(unmasked_count(layer, inputs))
        return super().element_counts(layer, inputs, mask)

    def detached(self, value):
        # Read only under torch.no_grad() (see `micro_batch_added`).
        return value

    def move_unpooled(self, model):
        """Moves, by Keras's rule, the statistics of each layer whose
        momentum was pinned but which the step called a number of times
        its graph does not show (its statistics move per micro-batch)."""
        variables = model.non_trainable_variables
        with torch.no_grad():
            for layer, (mean_at, variance_at), calls, pooled in zip(
                    self.layers, self._positions, self._records,
                    self.pooled):
                if pooled or not calls:
                    continue
                momentum = layer.momentum
                for _, mean, variance in calls:
                    for at, value in ((mean_at, mean),
                                      (variance_at, variance)):
                        moving = variables[at]
                        old = ops.cast(moving.value, value.dtype)
                        moving.assign(old * momentum
                                      + value * (1.0 - momentum))

    def micro_batch_added(self, sums, moments, non_trainable):
        entries = [
            (index, count, mean, variance, non_trainable[mean_at])
            for first, recorded, (mean_at, _) in zip(
                self._first, moments, self._positions)
            for index, (count, mean, variance) in enumerate(
                recorded or (), start=first)]
        if not entries or not all(
                isinstance(count, float) and mean.dtype == torch.float32
                and variance.dtype == torch.float32
                and shift.dtype == torch.float32
                for _, count, mean, variance, shift in entries):
            return super().micro_batch_added(sums, [
                None if recorded is None else [
                    (ops.full(ops.shape(mean), count, "float32")
                     if isinstance(count, float) else count, mean, variance)
                    for count, mean, variance in recorded]
                for recorded in moments], non_trainable)
        rows = self._rows_for(sums)
        counts = [count for _, count, _, _, _ in entries]
        with torch.no_grad():
            # Per channel: count, count * (mean - shift) and
            # count * (variance + (mean - shift)^2), as
            # `arithmetic.statistics_terms` (every count is positive).
            offsets = torch._foreach_sub([e[2] for e in entries],
                                         [e[4] for e in entries])
            squares = torch._foreach_mul(offsets, offsets)
            torch._foreach_add_(squares, [e[3] for e in entries])
            torch._foreach_mul_(offsets, counts)
            torch._foreach_mul_(squares, counts)
            for row, terms in enumerate((None, offsets, squares)):
                targets = [rows[index][row] for index, *_ in entries]
                if terms is None:
                    torch._foreach_add_(targets, counts)
                else:
                    torch._foreach_add_(targets, terms)
        return list(sums)

    def _rows_for(self, sums):
        """Views of each entry's three rows, made once per set of sums (the
        window makes new ones when it empties)."""
        if self._rows_of is None or any(
                a is not b for a, b in zip(self._rows_of, sums)):
            self._rows_of = list(sums)
            self._rows = [tuple(total.unbind(0)) for total in sums]
        return self._rows
