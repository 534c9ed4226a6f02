"""accum_model: gradient accumulation for Keras `fit()`, exact to the large batch."""

from accum_model._version import __version__
from accum_model._existing_models import accumulating
from accum_model.accumulating_model import AccumulatingModel

__all__ = ["AccumulatingModel", "accumulating", "__version__"]
