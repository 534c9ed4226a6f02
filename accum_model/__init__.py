"""accum_model: gradient accumulation for Keras `fit()`, exact to the large batch."""

from accum_model._version import __version__
# Chooses the Keras adapter, or refuses the stack with the fix, first.
from accum_model import _chooser  # noqa: F401  isort: skip

from accum_model._existing_models import accumulating  # noqa: E402
from accum_model.accumulating_model import AccumulatingModel  # noqa: E402
from accum_model.large_batch_check import (  # noqa: E402
    LargeBatchComparison, compare_with_large_batch)
from accum_model.window_from_noise_scale import (  # noqa: E402
    WindowFromNoiseScale)

__all__ = ["AccumulatingModel", "LargeBatchComparison", "WindowFromNoiseScale",
           "accumulating", "compare_with_large_batch", "__version__"]
