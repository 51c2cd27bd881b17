"""TEST STUB."""
from .. import functional as _f  # noqa: F401
from . import functional  # noqa: F401
