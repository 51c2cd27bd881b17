"""SGLang's side of the post-processing census (:mod:`engine_ext.server.census`): taken around SGLang's
``DefaultModelLoader.postprocess_weights`` (every loader's post-processing step in SGLang 0.5.23). The
SGLang adapter refreshes nothing, so it claims nothing: any copy post-processing derives in a module
holding checkpoint weights makes them unreproducible (updates writing them are refused)."""

from __future__ import annotations

from ...server.census import CENSUS_ATTR, take
from . import compat


def wrap_post_processing() -> bool:
    """Install the census around SGLang's post-processing (idempotent). False where SGLang has no such step."""
    try:
        loader_class = compat.default_model_loader_class()
    except ImportError:
        return False
    orig = loader_class.__dict__.get("postprocess_weights")
    if orig is None:
        return False
    fn = orig.__func__ if isinstance(orig, staticmethod) else orig
    if getattr(fn, CENSUS_ATTR, False):
        return True

    def postprocess_weights(model, target_device):
        take(model, lambda: fn(model, target_device))

    setattr(postprocess_weights, CENSUS_ATTR, True)
    postprocess_weights.original = fn
    loader_class.postprocess_weights = staticmethod(postprocess_weights)
    return True


__all__ = ["wrap_post_processing"]
