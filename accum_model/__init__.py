"""accum_model: gradient accumulation for Keras `fit()`, exact to the large batch."""

from accum_model._version import __version__
from accum_model._stack import check_stack

check_stack()
del check_stack

from accum_model._existing_models import accumulating  # noqa: E402
from accum_model.accumulating_model import AccumulatingModel  # noqa: E402

__all__ = ["AccumulatingModel", "accumulating", "__version__"]
