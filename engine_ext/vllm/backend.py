"""The ``delta`` weight-transfer backend: vLLM's own update API drives our apply.

With ``weight_transfer_config={"backend": "delta"}`` (``--weight-transfer-config
'{"backend": "delta"}'``), ``LLM.update_weights({"update_info": {"url": ...}})`` and
vLLM's RL routes make every worker fetch and decode the delta itself (allowed
sources only), apply it in place, and verify the fingerprints across ranks with
an all-reduce; on any mismatch every rank rolls back and the call raises.
Unlike the HTTP endpoint there is no served-version bookkeeping here: a delta on
the wrong base simply fails verification and is rolled back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .. import fingerprint as fpr
from ..errors import VerifyError
from ..service import Sources
from .worker import updater_for

_BIG = 1 << 62


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    url: str | None = None  # manifest URI or path (must be under ENGINE_EXT_SOURCES)
    path: str | None = None  # or a staged file from engine_ext.updater.stage_delta


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def combine_collective(report: dict[str, list], rank: int) -> dict[str, tuple[int, int]]:
    """Whole-tensor (fingerprint, covered) across all ranks with two all-reduces.

    Same rule as :func:`engine_ext.service.combine_fingerprints`: the lowest rank that
    holds a whole tensor speaks for it; otherwise the disjoint shards add up.
    """
    import torch.distributed as dist

    names = list(report)
    fps = [fpr.parse(report[n][0]) for n in names]
    cov = [report[n][1] for n in names]
    numel = [report[n][2] for n in names]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {n: (f, c) for n, f, c in zip(names, fps, cov)}
    from vllm.distributed import get_world_group

    group = get_world_group().cpu_group
    full = torch.tensor([rank if c == n else _BIG for c, n in zip(cov, numel)], dtype=torch.int64)
    dist.all_reduce(full, op=dist.ReduceOp.MIN, group=group)
    speak = [int(f) == _BIG or int(f) == rank for f in full]
    acc = torch.tensor([[_signed(f) if s else 0, c if s else 0] for f, c, s in zip(fps, cov, speak)], dtype=torch.int64).reshape(-1, 2)
    dist.all_reduce(acc, group=group)
    return {n: (int(a) & fpr.MASK64, int(c)) for n, (a, c) in zip(names, acc.tolist())}


def _all_ok(ok: bool) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    from vllm.distributed import get_world_group

    t = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_world_group().cpu_group)
    return bool(t.item())


class DeltaWeightTransferEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        updater_for(self.model, self.vllm_config, self._rank()).setup()

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises an accelerator, which fails on CPU-only hosts;
        # our apply is synchronous already.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: DeltaUpdateInfo) -> None:
        from ..reader import load_delta

        if (info.url is None) == (info.path is None):
            raise ValueError('update_info needs exactly one of "url" or "path"')
        rank = self._rank()
        up = updater_for(self.model, self.vllm_config, rank)
        tensors, expected = None, None
        err = None
        try:
            if info.url is not None:
                delta = load_delta(Sources.from_env().check(info.url))
                tensors, expected = delta.tensors, delta.version
                reply = up.apply(deltas=tensors)
            else:
                reply = up.apply(path=info.path)
        except Exception as e:  # noqa: BLE001 - every rank must take part in the collectives below
            err, reply = e, None
        if not _all_ok(err is None):
            up.rollback()
            raise err if err is not None else RuntimeError("delta apply failed on another rank; rolled back")
        got = combine_collective(reply["fingerprints"], rank)
        from ..updater import load_staged

        tds = tensors if tensors is not None else load_staged(info.path)
        bad = [td.name for td in tds if td.fingerprint is not None and (got[td.name][0] != td.fingerprint or got[td.name][1] != td.numel)]
        if bad:
            up.rollback()
            raise VerifyError(f"fingerprint mismatch after apply (wrong base?) in {bad[:5]}; every rank rolled back")
        up.commit(expected)

    def shutdown(self) -> None:
        pass
