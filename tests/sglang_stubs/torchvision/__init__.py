"""TEST STUB (tests/sglang_stubs/README.md): names only, not the real torchvision."""
from . import io, transforms  # noqa: F401

__version__ = "0.0.0+engine-ext-test-stub"


def _unavailable(*args, **kwargs):
    raise RuntimeError("torchvision is a test stub here (tests/sglang_stubs); install the real one")
