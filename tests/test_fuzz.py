"""The parsers under fuzzing (issue 30): a fixed, deterministic budget of every target of
``tests/fuzz_targets.py`` in CI, and one explicit regression test per bug the fuzzers found.

Each target starts from real data (a signed store published by the real publisher, streams
from the real encoders) and mutates it; the only outcomes allowed are an accepted valid
input or the documented refusal, within a time and an allocation bound per example
(``fuzz_targets.judge``). ``derandomize=True``: every CI run tries the same inputs. The long
campaign, with its figures, is ``bench/fuzz_campaign.py`` (docs/RELIABILITY.md).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings as hsettings

from fuzz_targets import TARGETS


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_target(name):
    t = TARGETS[name]

    @hsettings(max_examples=t.examples, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(t.strategy())
    def run(case):
        t.check(case)

    run()
