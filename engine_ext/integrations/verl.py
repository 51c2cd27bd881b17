"""verl in the loop: engine_ext as a registered checkpoint engine, so that a verl run moves each
policy version to its rollout replicas as one signed delta through a store (docs/VERL.md).

Importing this module registers :class:`EngineExtCheckpointEngine` as ``engine_ext`` in verl's
``CheckpointEngineRegistry``. verl imports it wherever it builds a checkpoint engine when the
config names it (``checkpoint_engine.custom_backend_module``)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=engine_ext
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=engine_ext.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.engine_ext.store=s3://bucket/run1

What runs where:

* **Actor workers** (verl's ``update_weights`` on every trainer rank): verl hands a custom backend
  ``get_per_tensor_param()``, whose FSDP form gathers each parameter (``full_tensor()``, a
  collective). Every rank drains it; the sender (rank 0, verl's ``is_master``) publishes the
  tensors as one signed version with :class:`~engine_ext.trainer.publisher.DeltaPublisher`, numbered
  by ``global_steps``. With ``patches/verl/`` applied, verl hands the training engine instead and
  every rank publishes the rows it holds (:class:`~engine_ext.trainer.sharded.ShardedPublisher`):
  nothing is gathered.
* **The driver** (:class:`EngineExtCheckpointManager`: verl's own manager becomes one at its first
  sync, :func:`_route_stock_managers`; ``rollout.checkpoint_manager_class`` may also name it): after
  the actors published, it POSTs the version to every replica's ``/update_weights_delta``, on the
  HTTP server verl started for it. verl builds vLLM's app with vLLM's own ``build_app`` and
  ``init_app_state``, which mount engine_ext's endpoint plugin, and vLLM loads the general plugin
  in its workers; both load whenever engine_ext is installed and ``VLLM_PLUGINS`` is unset or names
  ``engine_ext``. Each replica fetches only its ranks' changed bytes, verifies them and applies
  them in place, all ranks or none, through the same transaction as any other update (one served
  state, rollback on failure). No process group is built, no dense copy crosses IPC, no kv cache
  is released. A replica that joined late or restarted is taken along its own route (a chain,
  or the newest anchor) by the same request.
* **Rollout workers** (verl's ``CheckpointEngineWorker``): not used. :meth:`receive_weights` says
  which manager to configure, since verl's stock manager would stream dense tensors to them.

A sync that does not bring every replica to the version with the trainer's fingerprint raises
:class:`~engine_ext.fleet.WeightSyncError` naming each replica (its rank and address) and its
reason; the replicas that refused keep serving what they had.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await

from .. import settings
from ..errors import DeltaError
from ..fleet import Fleet, FleetResult, WeightSyncError, publish_committed
from ..format import fingerprint as fpr
from ..format.manifest import ANCHOR, DELTA, Manifest, manifest_key
from ..trainer.publisher import DeltaPublisher, open_publisher
from ..trainer.sharded import ShardedPublisher

log = logging.getLogger("engine_ext")

BACKEND = "engine_ext"
# What a sender's metrics carry to the manager besides numbers (popped before verl logs them).
MANIFEST_KEY, FINGERPRINT_KEY = f"{BACKEND}/manifest", f"{BACKEND}/fingerprint"


@dataclass
class VerlSyncOptions:
    """``checkpoint_engine.engine_kwargs.engine_ext``: what :class:`DeltaTrainerInitInfo`
    (:mod:`engine_ext.integrations.vllm_transfer`) carries, plus the driver's push settings.

    ``store``: where versions go (local path, ``s3://``, ``http(s)://``, ``hf://``); the replicas must
    be allowed to read it (their ``ENGINE_EXT_SOURCES``). ``signing_key``: the publisher's Ed25519
    private key (PEM path; default ``ENGINE_EXT_SIGNING_KEY``), whose public key the replicas trust
    (``ENGINE_EXT_TRUSTED_KEYS``). ``anchor_every``: a full anchor every K versions. ``dtype``: the
    served dtype the trainer's floating-point weights are cast to (``None``: as they are).
    ``model``: the identity written into manifests. ``token``: the replicas' update-route token
    (default ``ENGINE_EXT_TOKEN``). ``abort_requests``: abort in-flight requests around a sync and
    resume them after, as verl's own manager does for partial rollouts (``False``: generation
    continues while a version is fetched; each replica pauses only while it applies).
    ``retries``/``timeout_s``: per replica (:class:`~engine_ext.fleet.Fleet`). ``sharded``: where verl
    hands over the training engine (``patches/verl/``), every actor rank publishes its own rows
    (``False``: the gathered stream, from rank 0, even then). ``publisher``: more
    :class:`~engine_ext.trainer.publisher.DeltaPublisher` arguments (``keep_on_cpu``,
    ``chunk_min_cell``, ``quantize``, ``resume``, ...).
    """

    store: str
    signing_key: str | None = None
    anchor_every: int = 50
    dtype: str | None = "bfloat16"
    model: str = "model"
    token: str | None = None
    abort_requests: bool = True
    retries: int = 4
    timeout_s: float = 900.0
    sharded: bool = True
    publisher: dict = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, kwargs) -> VerlSyncOptions:
        """From verl's ``engine_kwargs.engine_ext`` (a dict or an OmegaConf node); an unknown key is an error."""
        kwargs = _plain(kwargs or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"engine_kwargs.{BACKEND}: unknown option(s) {unknown}; known: {sorted(known)}")
        if not kwargs.get("store"):
            raise ValueError(
                f"engine_kwargs.{BACKEND}.store is required: the store versions are published to "
                f"(+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{BACKEND}.store=s3://bucket/run)"
            )
        return cls(**kwargs)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        if self.dtype in (None, "None", "none", "auto"):
            return None
        return getattr(torch, str(self.dtype).removeprefix("torch."))


def _plain(node) -> Any:
    """An OmegaConf node (what verl hands over) as plain dicts and lists."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(node, (DictConfig, ListConfig)):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    return node


@CheckpointEngineRegistry.register(BACKEND)
class EngineExtCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine contract over a store: the actor side publishes, replicas pull.

    Built by verl on every actor rank (``is_master`` on rank 0) and on every rollout worker, with
    ``engine_kwargs.engine_ext`` as keyword arguments (:class:`VerlSyncOptions`).
    """

    wire_format = "named_tensors"

    @property
    def takes_training_engine(self) -> bool:
        """Read by verl with ``patches/verl/`` applied: hand :meth:`send_weights` the training engine
        (every rank publishes its shards) instead of the gathered tensors."""
        return self.options.sharded

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **engine_kwargs):
        self.bucket_size, self.is_master = bucket_size, is_master
        self.options = VerlSyncOptions.from_kwargs(engine_kwargs)
        self.tied: dict[str, str] = {}  # {name the replicas do not load: the name they load it as}
        self._publisher: DeltaPublisher | ShardedPublisher | None = None

    # -- lifecycle (verl calls these around every sync; a store needs none of it) ------------------
    def prepare(self) -> dict[str, Any]:
        """Before each sync, on every worker: verl gathers this for :meth:`build_topology`. Nothing
        to connect: the store is the rendezvous."""
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """No process group between actors and replicas: no per-worker arguments."""
        return {}, {}

    def init_process_group(self, **kwargs) -> None:
        """Nothing to join (see :meth:`build_topology`)."""

    def finalize(self) -> None:
        """After each sync: nothing to free (the publisher keeps the last version's bits for the next diff)."""

    # -- the actor side ---------------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        """On every actor rank, once per sync. ``weights``: verl's ``get_per_tensor_param()`` generator
        (drained on every rank: FSDP gathers collectively; rank 0 publishes), or, with
        ``patches/verl/``, the training engine (every rank publishes its rows). Returns the sync's
        metrics on the sender (rank 0 of a sharded version), ``{}`` elsewhere."""
        t0 = time.perf_counter()
        if hasattr(weights, "get_per_tensor_param"):  # the training engine (patched verl)
            module = getattr(weights, "module", None)
            if isinstance(module, torch.nn.Module):  # FSDP: the rows each rank holds
                return self._publish_shards(module, global_steps, t0)
            weights, _ = weights.get_per_tensor_param()  # another engine (Megatron, ...): its gathered stream
        if not self.is_master:
            for _ in weights:  # every parameter is gathered collectively: this rank takes part and drops it
                pass
            return {}
        pub = self._open(DeltaPublisher)
        uri = pub.publish(self._leave_out_tied(weights), self._version(pub, global_steps))
        pub.wait()
        return self._metrics(pub, uri, pub.last_nbytes, time.perf_counter() - t0)

    def leave_out_tied(self, tied: dict[str, str]) -> None:
        """Called by :class:`EngineExtCheckpointManager` (through verl's ``execute_checkpoint_engine``)
        with what the replicas tie: ``{lm_head.weight: model.embed_tokens.weight}`` for a tied model.
        verl's gathered stream carries such a tensor twice, as two tensors that share no storage
        (``full_tensor()`` per name), so the publisher cannot see the tie; the copy is left out once
        checked equal to the tensor it is tied to."""
        self.tied = dict(tied)

    def _leave_out_tied(self, weights):
        """``weights`` without the tied copies the replicas do not load (see :meth:`leave_out_tied`),
        each checked bit-equal to the tensor it stands for; the two ends of a tie are held until both
        have passed (an embedding), nothing else is."""
        kept = set(self.tied.values())
        held = {}
        for name, t in weights:
            t = t.detach()
            if name in self.tied or name in kept:
                held[name] = t
            if name not in self.tied:
                yield name, t
        for copy, name in self.tied.items():
            if copy in held and not (name in held and _bit_equal(held[copy], held[name])):
                raise DeltaError(
                    f"the replicas serve {copy} as {name} (tied), but the trainer's {copy} differs from "
                    f"its {name}: a model trained untied cannot be served tied; serve it untied"
                )

    def _publish_shards(self, module: torch.nn.Module, global_steps: int | None, t0: float) -> dict:
        pub = self._open(ShardedPublisher)
        uri = publish_committed(pub, module, self._version(pub, global_steps))
        if pub.rank != 0:
            return {}
        return self._metrics(pub, uri, pub.model_nbytes, time.perf_counter() - t0)

    def _open(self, kind):
        if self._publisher is None:
            o = self.options
            self._publisher = open_publisher(kind, o, o.torch_dtype)
        return self._publisher

    @staticmethod
    def _version(pub, global_steps: int | None) -> int:
        """The version follows verl's ``global_steps`` where it can: the same step synced twice (verl syncs
        again after validation) or a resumed run behind the store's head takes the next free version."""
        if global_steps is None:
            return pub.next_version
        return max(int(global_steps), pub.next_version)

    def _metrics(self, pub, uri: str, dense_bytes: int, seconds: float) -> dict:
        kind = ANCHOR if uri.endswith(f".{ANCHOR}.json") else DELTA
        stored = Manifest.from_json(pub.store.read(manifest_key(pub.version, kind))).payload_bytes
        return {
            f"{BACKEND}/version": pub.version,
            f"{BACKEND}/stored_bytes": stored,
            f"{BACKEND}/dense_bytes": dense_bytes,
            f"{BACKEND}/changed_share": pub.last_changed / max(pub.last_numel, 1),
            f"{BACKEND}/publish_s": seconds,
            MANIFEST_KEY: uri,
            FINGERPRINT_KEY: fpr.fmt(pub.fingerprint),
        }

    # -- the rollout side -------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None):
        """verl's stock manager would call this on rollout workers to stream dense tensors into the engine;
        engine_ext's replicas pull and apply in place instead, driven by :class:`EngineExtCheckpointManager`
        (which a stock manager becomes: :func:`_route_stock_managers`). Reached only by a manager that
        is neither: its sync fails here, with what to configure."""
        raise DeltaError(
            f"the {BACKEND} checkpoint engine applies versions in place on the replicas' servers, driven by "
            f"{__name__}.EngineExtCheckpointManager; a manager that streams tensors to the rollout workers "
            f"called it: set +actor_rollout_ref.rollout.checkpoint_manager_class="
            f"{__name__}.EngineExtCheckpointManager"
        )
        yield  # pragma: no cover - an async generator, as verl's contract says

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def replica_url(replica) -> str:
    """A verl ``RolloutReplica``'s HTTP address (``server_address`` is ``host:port``)."""
    address = replica.server_address
    if not address:
        raise WeightSyncError(f"replica {getattr(replica, 'replica_rank', '?')} has no server address (not launched)")
    return address if "://" in address else f"http://{address}"


class EngineExtCheckpointManager(CheckpointEngineManager):
    """verl's ``CheckpointEngineManager`` whose sync is: the actors publish, every replica pulls and
    applies in place (``rollout.checkpoint_manager_class``; the module docstring says what runs where).

    ``syncs``: one dict of metrics per sync (what :meth:`update_weights` returned to verl). ``last``: the
    last sync's :class:`~engine_ext.fleet.FleetResult`, one entry per replica.
    """

    def __init__(self, config, actor_wg, replicas) -> None:
        super().__init__(config, actor_wg, replicas)  # imports custom_backend_module, looks the backend up
        self._take_over()

    def _take_over(self) -> None:
        """The state this manager adds to verl's (also run on a stock manager that becomes one: see
        :func:`_route_stock_managers`)."""
        if self.backend != BACKEND:
            raise ValueError(
                f"{type(self).__name__} drives the {BACKEND!r} checkpoint engine; the config names {self.backend!r}"
            )
        self.options = VerlSyncOptions.from_kwargs((self.config.engine_kwargs or {}).get(BACKEND))
        self.token = self.options.token or settings.current().token
        self.syncs: list[dict] = []
        self.last: FleetResult | None = None
        self._uri: str | None = None
        self._fingerprint: str | None = None
        self._tied: dict[str, str] | None = None  # what the replicas tie (learned before the first sync)

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict:
        """Once per sync, on the driver: the actors publish version ``global_steps``, then every replica
        is brought to it; returns numeric metrics for verl's logger. Raises
        :class:`~engine_ext.fleet.WeightSyncError` naming each replica that did not get there."""
        import ray

        if self.options.abort_requests:
            await self.abort_replicas()
        try:
            if self._tied is None:
                self._tell_actors_the_ties()
            results = ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend))
            sent = {}
            for r in results:
                if isinstance(r, dict):
                    sent.update(r)
            if MANIFEST_KEY not in sent:
                raise WeightSyncError(
                    f"no actor rank published a version (is rank 0's checkpoint engine the {BACKEND!r} backend?)"
                )
            self._uri, self._fingerprint = sent.pop(MANIFEST_KEY), sent.pop(FINGERPRINT_KEY)
            t0 = time.perf_counter()
            result = self._bring(self.replicas)
            sent[f"{BACKEND}/apply_s"] = time.perf_counter() - t0
            sent[f"{BACKEND}/fetched_bytes"] = max((r.fetched_bytes or 0) for r in result.replicas)
            sent[f"{BACKEND}/pause_ms"] = max((r.pause_ms or 0.0) for r in result.replicas)
        finally:
            if self.options.abort_requests:
                await self.resume_generation_replicas()
        self.syncs.append(dict(sent))
        return sent

    def _tell_actors_the_ties(self) -> None:
        """The replicas' tied names (their ``GET /update_weights_delta`` layout's ``ties``), handed to every actor
        rank's checkpoint engine through verl's ``execute_checkpoint_engine``."""
        import ray

        fleet = Fleet([replica_url(r) for r in self.replicas], self.token)
        tied: dict[str, str] = {}
        for url in fleet.urls:
            tied.update(((fleet.status(url) or {}).get("layout") or {}).get("ties") or {})
        n = self.actor_wg.world_size
        ray.get(self.actor_wg.execute_checkpoint_engine(["leave_out_tied"] * n, [tied] * n))
        self._tied = tied

    def add_replicas(self, replicas) -> None:
        """Replicas joining a running job (verl's elastic scale-up) are brought to the last synced version
        at once, each along its own route from what it serves; later syncs include them."""
        super().add_replicas(replicas)
        if self._uri is not None:
            self._bring(list(replicas))

    def _bring(self, replicas) -> FleetResult:
        urls = [replica_url(r) for r in replicas]
        names = {u: f"replica {getattr(r, 'replica_rank', i)} ({u})" for i, (u, r) in enumerate(zip(urls, replicas))}
        fleet = Fleet(urls, self.token, retries=self.options.retries, timeout_s=self.options.timeout_s)
        self.last = fleet.bring(self._uri, self._fingerprint, names)  # WeightSyncError names each replica that failed
        return self.last


def _route_stock_managers() -> None:
    """Let verl's own ``CheckpointEngineManager`` drive the ``engine_ext`` backend as
    :class:`EngineExtCheckpointManager` does, so that no manager line is needed.

    verl's trainers build the stock manager themselves: ``RayPPOTrainer`` reads
    ``rollout.checkpoint_manager_class``, but the fully async trainer and the v1 separate-async
    trainer do not. Its sync would stream dense tensors to the rollout workers, which engine_ext's
    replicas do not take. The stock manager imports this module (``custom_backend_module``) while
    it is being built, so its class is swapped at the first sync instead: ``update_weights`` and
    ``add_replicas`` of a stock manager whose backend is ``engine_ext`` make it an
    :class:`EngineExtCheckpointManager` first. Any other backend is untouched. Applied once, at
    import (patches/README.md, "verl").
    """
    stock = CheckpointEngineManager
    if getattr(stock, "_engine_ext_routed", False):
        return
    original = {name: getattr(stock, name) for name in ("update_weights", "add_replicas")}

    def routed(name):
        def method(self, *args, **kwargs):
            if type(self) is stock and self.backend == BACKEND:
                self.__class__ = EngineExtCheckpointManager
                self._take_over()
                return getattr(EngineExtCheckpointManager, name)(self, *args, **kwargs)
            return original[name](self, *args, **kwargs)  # any other backend; and super() calls of a subclass

        method.__name__, method.__doc__ = name, original[name].__doc__
        return method

    for name in original:
        setattr(stock, name, routed(name))
    stock._engine_ext_routed = True


_route_stock_managers()

__all__ = ["BACKEND", "EngineExtCheckpointEngine", "EngineExtCheckpointManager", "VerlSyncOptions", "replica_url"]
