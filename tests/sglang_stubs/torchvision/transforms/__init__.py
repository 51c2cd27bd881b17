"""TEST STUB: names imported at module level by SGLang and transformers."""
from . import functional  # noqa: F401
from .functional import InterpolationMode  # noqa: F401


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a test stub here (tests/sglang_stubs)")


Compose = Lambda = Resize = ToTensor = Normalize = CenterCrop = ToPILImage = _Unavailable
