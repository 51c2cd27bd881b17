"""TEST STUB: the enum and function names imported at module level."""
from enum import Enum


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):  # resize, pil_to_tensor, normalize, ...: importable, not callable
    def _unavailable(*args, **kwargs):
        raise RuntimeError(f"torchvision.transforms.functional.{name} is a test stub here")

    return _unavailable
