"""vLLM's trainer-side weight-transfer API with engine_ext as the backend: a trainer written against
vLLM's API changes one name (``nccl`` -> ``engine_ext``) and its servers receive signed deltas
from a store.

Importing this module registers :class:`DeltaTrainerWeightTransferEngine` under ``engine_ext`` in
vLLM's ``WeightTransferTrainerFactory`` (idempotent); the servers run the worker side under the
same name (``--weight-transfer-config '{"backend": "engine_ext"}'``, docs/vllm.md)::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from engine_ext.integrations.vllm_transfer import DeltaTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaTrainerInitInfo("s3://bucket/run1", rank=rank),
        client=HTTPVLLMWeightSyncClient("http://server:8000"),  # or an LLM, a Ray client, a list of them
        source=ModuleSource(model))
    for step in ...:
        ...  # optimizer step
        engine.send_weights()

``send_weights`` is called on every trainer rank. With ``source=ShardSource(model)`` (an FSDP2
``fully_shard`` model, or pipeline / expert parallel ranks naming ``held_names``) every rank
publishes the rows it holds through its own
:class:`~engine_ext.trainer.sharded.ShardedPublisher` and rank 0 commits the version once
every rank's part is in: nothing is gathered (:meth:`DeltaTrainerWeightTransferEngine.publish_version`).
With any other source (a plain ``ModuleSource``) every rank iterates it (FSDP gathers
are collective), as vLLM's contract says, and the sender (rank 0) publishes one signed version with
:class:`~engine_ext.trainer.publisher.DeltaPublisher` (an anchor first, deltas after, the
weights cast to ``dtype``), then drives ``start_weight_update``, ``update_weights({"url": ...})``
and ``finish_weight_update(str(version))`` on each client. The servers fetch only the changed
elements, verify them against the manifest's fingerprints (computed here from the trainer's
own tensors) and apply all ranks or none; a refusal raises here as
:class:`~engine_ext.errors.UpdateRefused` with the server's reason and status. Servers that
already hold the trainer's weights (started from the same checkpoint) adopt the first version
without fetching it, and a trainer restarted on the same store continues it (the publisher's
resume). Nothing passes through the trainer's network but the version's changed bytes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from ..errors import DeltaError, UpdateRefused
from ..format.dtypes import BY_TORCH
from ..format.manifest import ANCHOR, DELTA, Manifest, manifest_key
from ..trainer.publisher import DeltaPublisher, open_publisher
from ..trainer.sharded import ShardedPublisher
from .shard_source import ShardSource

log = logging.getLogger("engine_ext")
BACKEND = "engine_ext"


@dataclass
class DeltaTrainerInitInfo(TrainerInitInfo):
    """Where versions go and how they are made. ``store``: a Store or root URI (local path, ``s3://``,
    ``http(s)://``, ``hf://``) the servers may read (their ``ENGINE_EXT_SOURCES``);
    ``signing_key``: the publisher's Ed25519 private key (default ``ENGINE_EXT_SIGNING_KEY``), whose
    public key the servers trust; ``anchor_every``: a full anchor every K versions; ``dtype``: the
    served dtype the trainer's floating-point weights are cast to (``None``: as they are)."""

    backend: ClassVar[str] = BACKEND

    store: Any
    signing_key: Any = None
    anchor_every: int = 50
    dtype: torch.dtype | None = torch.bfloat16
    model: str = "model"  # the model identity written into manifests
    sources: list[str] | None = None  # sent in init_info: narrows the servers' allowed sources to these
    trusted_keys: list[str] | None = None  # sent in init_info: narrows the servers' trusted keys (PEM text or key ids)
    publisher: dict = field(default_factory=dict)  # more DeltaPublisher arguments (chunk_min_cell, resume, ...)


@dataclass
class SendStats:
    """One version sent: what it cost against the dense alternative (vLLM's ``nccl`` backend
    broadcasts the whole model in the served dtype every time)."""

    version: int
    kind: str  # "anchor" (the first version) or "delta"
    payload_bytes: int  # the version's blobs in the store: the most a server one version behind fetches, all ranks
    dense_bytes: int  # the model in the served dtype: what the nccl path sends per version
    changed: float  # share of the elements that changed
    publish_s: float  # iterate (gathers), cast, diff, encode, sign, upload
    update_s: float  # start, update (every server fetches, verifies, applies), finish, on every client


class DeltaTrainerWeightTransferEngine(TrainerWeightTransferEngine[DeltaTrainerInitInfo]):
    """vLLM's ``TrainerWeightTransferEngine`` over a store: see the module docstring."""

    init_info_cls = DeltaTrainerInitInfo

    def __init__(self, init_info: DeltaTrainerInitInfo, *, client, source):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.info, self.rank = init_info, init_info.rank  # (vLLM 0.33's base class keeps the rank too)
        self.clients = [
            LLMClient(c) if _is_offline_llm(c) else c
            for c in (client if isinstance(client, (list, tuple)) else [client])
        ]
        self.publisher: DeltaPublisher | None = None
        self.sharded = isinstance(source, ShardSource)  # every rank publishes its own rows
        if self.sharded:  # on every rank, at the same point (it opens the publishers' own gloo group)
            self.publisher = open_publisher(ShardedPublisher, init_info, init_info.dtype)
        elif self.is_sender:
            self.publisher = open_publisher(DeltaPublisher, init_info, init_info.dtype)
        self.sends: list[SendStats] = []

    @classmethod
    def trainer_init(cls, init_info: DeltaTrainerInitInfo, *, client, source=None) -> DeltaTrainerWeightTransferEngine:
        """On every trainer rank. The sender opens the publisher (resuming a store that holds versions)
        and calls every client's ``init_weight_transfer_engine`` with the narrowing it was given."""
        if source is None:
            raise ValueError("the engine_ext trainer weight transfer needs a WeightSource (e.g. ModuleSource(model))")
        engine = cls(init_info, client=client, source=source)
        if engine.is_sender:
            init = {
                k: v
                for k, v in (("sources", init_info.sources), ("trusted_keys", init_info.trusted_keys))
                if v is not None
            }
            engine._each(lambda c: c.init_weight_transfer_engine(init))
        return engine

    def send_weights(self) -> SendStats | None:
        """Publish one version and bring every client's server to it; on every trainer rank (the
        sender's answer: what it cost; None on the others)."""
        t0 = time.perf_counter()
        uri = self.publish_version()
        if not self.is_sender:
            return None
        t1 = time.perf_counter()
        version = self.publisher.version
        self._each(lambda c: self._update(c, uri, str(version)))
        stats = SendStats(
            version,
            self._kind,
            self._payload_bytes(version),
            self._dense_bytes,
            self._changed / max(self._numel, 1),
            t1 - t0,
            time.perf_counter() - t1,
        )
        self.sends.append(stats)
        log.info(
            "engine_ext: sent v%d (%s): %d B against %d B dense, published in %.3f s, applied in %.3f s",
            version,
            stats.kind,
            stats.payload_bytes,
            stats.dense_bytes,
            stats.publish_s,
            stats.update_s,
        )
        return stats

    def publish_version(self) -> str | None:
        """Every rank iterates the source (materialising is collective); the sender publishes the
        weights, cast to the served dtype, as one signed version and waits until it is stored.
        Returns its manifest URI on the sender, None elsewhere. A :class:`ShardSource` publishes per
        rank instead (:meth:`_publish_shards`): no rank iterates it, nothing is gathered."""
        if self.sharded:
            return self._publish_shards()
        pairs = self._pairs()
        if not self.is_sender:
            for _ in pairs:
                pass
            return None
        dtype, state = self.info.dtype, {}
        for name, tensor in pairs:
            if tensor is None:
                raise ValueError(
                    f"{name}: the sender does not hold this parameter (a split producer, held_names()); "
                    "publishing it needs every rank to publish its own part"
                )
            tensor = tensor.detach()
            state[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        uri = self.publisher.publish(state)
        self.publisher.wait()
        self._kind = ANCHOR if uri.endswith(f".{ANCHOR}.json") else DELTA
        self._numel = sum(t.numel() for t in state.values())
        self._dense_bytes = sum(t.numel() * t.element_size() for t in state.values())
        self._changed = self.publisher.last_changed
        return uri

    def _publish_shards(self) -> str | None:
        """Every rank publishes the rows it holds (:meth:`ShardSource.publish`) and waits until rank 0
        committed the version; a version a rank failed is committed nowhere, and raises on every rank
        (the servers keep the last committed one; the next version is an anchor)."""
        pub = self.publisher
        uri = self.source.publish(pub)
        pub.wait()
        if pub.version in pub.aborted:
            raise DeltaError(
                f"v{pub.version} was not published (nothing committed, the servers keep "
                f"v{max(pub._committed, default=None)}): {pub.aborted[pub.version]}"
            )
        self._kind = ANCHOR if uri.endswith(f".{ANCHOR}.json") else DELTA
        meta = self.source.metadata()  # full shapes, no gather
        self._numel = sum(math.prod(m.shape) for m in meta)
        self._dense_bytes = sum(math.prod(m.shape) * BY_TORCH[m.dtype].itemsize for m in meta)
        # changed: this rank's share, scaled to the model (the ranks' counts are not summed: no collective)
        self._changed = pub.last_changed * self._numel / max(pub.last_numel, 1)
        return uri if self.is_sender else None

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    # ---- helpers
    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        source = self.source
        iter_full = getattr(source, "iter_full", None)  # vLLM 0.33's name for the gathered stream
        return iter_full() if callable(iter_full) else iter(source)

    def _payload_bytes(self, version: int) -> int:
        store = self.publisher.store
        return Manifest.from_json(store.read(manifest_key(version, self._kind))).payload_bytes

    @staticmethod
    def _update(client, uri: str, version: str) -> None:
        client.start_weight_update()
        client.update_weights({"url": uri})
        client.finish_weight_update(version)

    def _each(self, call) -> None:
        """``call(client)`` for every client at once; raises :class:`UpdateRefused` (the first refusal's
        reason and status, every failure named) if any of them failed."""
        if len(self.clients) == 1:
            failures = []
            try:
                call(self.clients[0])
            except Exception as e:  # noqa: BLE001 - translated below
                failures.append((0, e))
        else:

            def one(i):
                try:
                    call(self.clients[i])
                    return None
                except Exception as e:  # noqa: BLE001
                    return i, e

            with ThreadPoolExecutor(len(self.clients)) as pool:
                failures = [f for f in pool.map(one, range(len(self.clients))) if f is not None]
        if not failures:
            return
        refusals = [(i, refusal(e)) for i, e in failures]
        if len(self.clients) == 1:
            raise refusals[0][1] from failures[0][1]
        first = refusals[0][1]
        raise UpdateRefused(
            first.reason,
            first.http_status,
            f"{len(failures)} of {len(self.clients)} server(s) refused or failed: "
            + "; ".join(f"client {i}: [{r.http_status} {r.reason}] {r.error}" for i, r in refusals),
        ) from failures[0][1]


class LLMClient:
    """``VLLMWeightSyncClient`` over an in-process ``vllm.LLM``, whose own methods take vLLM's request
    objects (``{"update_info": ...}``) rather than the client protocol's plain payloads; applied to
    an ``LLM`` passed as a client automatically."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def _is_offline_llm(client) -> bool:
    from vllm.entrypoints.rl.offline import RLOfflineMixin

    return isinstance(client, RLOfflineMixin)


def refusal(e: BaseException) -> UpdateRefused:
    """A client's failure as the server's refusal: vLLM's HTTP client raises ``requests.HTTPError``
    (the route's status and ``{"reason", "error"}`` body are on its response); an offline ``LLM``
    raises the workers' error, whose text carries the refusal; anything else is a 500 ``internal``."""
    response = getattr(e, "response", None)
    if response is not None and getattr(response, "status_code", None):
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("reason"):
            return UpdateRefused(str(body["reason"]), response.status_code, str(body.get("error", ""))[:2000])
        return UpdateRefused("http", response.status_code, (response.text or str(e))[:2000])
    return UpdateRefused.find(str(e)) or UpdateRefused.of(e)


def register() -> None:
    """Register the trainer engine under ``engine_ext`` (lazily, by module path; idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "DeltaTrainerWeightTransferEngine")
    except ValueError:  # already registered: by an earlier import of this module
        pass


register()

__all__ = [
    "BACKEND",
    "DeltaTrainerInitInfo",
    "DeltaTrainerWeightTransferEngine",
    "LLMClient",
    "SendStats",
    "ShardSource",
    "refusal",
    "register",
]
