"""Every refusal engine_ext can answer with: a snake_case reason (a metrics label, a JSON value, what
:meth:`UpdateRefused.find` reads back), one reason per meaning, a 4xx/5xx status; and a rank's out-of-order
step answers its own reason and status through the HTTP layer, not 500 ``internal``."""
from __future__ import annotations

import asyncio
import importlib
import pkgutil
import re

import pytest
import torch

import engine_ext
from engine_ext.errors import DeltaError, OutOfOrderError, UpdateRefused
from engine_ext.server.controller import Auth, Controller
from engine_ext.server.http import post_answer
from engine_ext.server.maps import UndoLog
from engine_ext.server.transaction import check_replies
from fake_ranks import FakeRanks, make_rank

REASON = re.compile(r"^[a-z][a-z0-9_]*$")


def _all_error_classes() -> list[type[DeltaError]]:
    """DeltaError and every subclass in engine_ext (each module imported that this venv can import)."""
    for mod in pkgutil.walk_packages(engine_ext.__path__, "engine_ext."):
        try:
            importlib.import_module(mod.name)
        except ImportError:  # an engine or optional dependency this venv lacks (SGLang, Triton...)
            continue
    out, todo = [], [DeltaError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in out if c.__module__.startswith("engine_ext")]


CLASSES = _all_error_classes()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_reason_and_status(cls):
    assert REASON.match(cls.reason), cls.reason
    assert isinstance(cls.http_status, int) and 400 <= cls.http_status <= 599, cls.http_status
    if cls is not UpdateRefused:  # carries another error's reason and status
        refused = UpdateRefused.find(str(UpdateRefused.of(cls("why"))))
        assert (refused.reason, refused.http_status) == (cls.reason, cls.http_status)


def test_one_reason_per_meaning():
    """A class that names its own reason names one no other class names (a subclass that means the same
    thing, more narrowly, inherits its parent's: PartlyHeld, SplitFrontEnd, ReadCut)."""
    owners: dict[str, list[str]] = {}
    for cls in CLASSES:
        if "reason" in cls.__dict__:
            owners.setdefault(cls.reason, []).append(f"{cls.__module__}.{cls.__name__}")
    assert {r: o for r, o in owners.items() if len(o) > 1} == {}
    assert len(CLASSES) >= 20, [c.__name__ for c in CLASSES]  # the walk found the classes outside errors.py too


def test_an_undo_log_used_twice_is_out_of_order():
    log = UndoLog([])
    log.rollback()
    with pytest.raises(OutOfOrderError):
        log.rollback()


def test_a_rank_step_out_of_order_answers_its_reason_over_http():
    """A rank asked to apply an update it fetched nothing for (what a driver that lost its place, or a
    second driver, would ask) refuses ``out_of_order``; the driver's check of the replies and the HTTP
    answer keep that reason and its 409, where a bare RuntimeError answered 500."""
    sd = {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}
    ranks = FakeRanks([make_rank(0, sd), make_rank(1, sd)])

    class LostDriver(Controller):
        async def update(self, req, policy=None):
            return check_replies(await self.ranks.call("apply", txn="never-fetched"))

    async def get_controller():
        return LostDriver(ranks)

    async def body():
        return b'{"url": "/nowhere/v00000001.json"}'

    status, answer = asyncio.run(post_answer(Auth(open=True), get_controller, None, body))
    assert (status, answer["reason"]) == (409, "out_of_order"), answer
    assert "nothing fetched for update never-fetched" in answer["error"]
