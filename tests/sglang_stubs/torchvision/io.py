"""TEST STUB: names transformers' image_utils imports at module level."""
from enum import Enum


class ImageReadMode(Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def decode_image(*args, **kwargs):
    raise RuntimeError("torchvision is a test stub here (tests/sglang_stubs)")
