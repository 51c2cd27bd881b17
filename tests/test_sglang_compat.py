"""SGLang touchpoints, checked statically against the installed SGLang's sources (run in the
SGLang virtualenv, like the other SGLang tests)."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="needs the SGLang virtualenv (.ci/setup-sglang.sh)")

from engine_ext.engines.compat import SourceTree, check  # noqa: E402
from engine_ext.engines.sglang import compat  # noqa: E402
from test_compat import installed  # noqa: E402

pytestmark = pytest.mark.sglang


def test_sglang_touchpoints_in_the_installed_sglang():
    import sglang

    assert sglang.__version__ in compat.CHECKED_ON
    assert check(SourceTree(installed("sglang")), compat.TOUCHPOINTS) == []
