"""BatchNormalization's moving statistics: left to the layer on Keras 2.

Checked on keras 2.13.1, 2.15.0 and tf-keras 2.21.0. Keras 2's
`BatchNormalization` moves its statistics inside a fused kernel for 4-D
inputs (with a Bessel-corrected variance) and by other paths otherwise;
a window does not take them over, so they move once per micro-batch and
`fit()` warns about every training BatchNormalization layer.
"""

import contextlib


@contextlib.contextmanager
def recording_batch_statistics(layers, spectral_writes=None):
    """Records nothing: every layer updates its own statistics.

    Yields:
        An empty list (the Keras 3 adapter's holds the recorded moments).
    """
    del layers, spectral_writes
    yield []
