"""TRL in the loop: the trainer's weights reach vLLM servers as signed deltas through a store.

TRL ships the whole model to vLLM over NCCL after every step (``VLLMClient.init_communicator``
refuses anything but CUDA, and trainer and servers must share a NCCL world). Here the
trainer publishes each version to a store (a bucket, an HTTP server, a shared disk) and
pushes it to the servers, which fetch only the changed elements, verify them and apply
them in place (docs/TRL.md):

* :class:`DeltaWeightTransfer` is TRL's weight-transfer protocol (``init_weight_transfer``,
  ``pause``, ``send_weights``, ``resume``, ``destroy``), what
  ``trl.experimental.async_grpo.AsyncGRPOTrainer(weight_transfer=...)`` accepts.
* :class:`DeltaGRPOTrainer` is ``GRPOTrainer`` in server mode whose weight sync is a delta:
  no NCCL communicator is opened (it runs on CPU and GPU), every sync publishes and pushes
  one version, and the server resets its prefix cache as part of the update.

The served weights equal the trainer's, cast to the served dtype, bit for bit: the
servers verify every update against the manifest's fingerprints, and
:meth:`DeltaWeightTransfer.send_weights` checks what each server answers against the
fingerprint the publisher computed from the trainer's tensors. That is what TRL's
importance-sampling correction assumes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..fleet import Fleet, FleetResult, WeightSyncError, publish_committed
from ..format import fingerprint as fpr
from ..format.dtypes import served_dtype
from ..trainer.checkpoint_layout import transformers_model
from ..trainer.publisher import DeltaPublisher
from ..trainer.sharded import ShardedPublisher

log = logging.getLogger("engine_ext")


@dataclass
class SyncStats:
    """One sync: the version, what crossed the network against the dense alternative, and how long it took."""

    version: int
    delta_bytes: int  # what each server fetched at most (all its ranks together)
    dense_bytes: int  # the model in the served dtype: what TRL's NCCL path broadcasts every sync
    publish_s: float  # cast, diff, encode, sign, upload (the trainer waits for it)
    push_s: float  # every server fetched, verified and applied it
    changed: float  # share of the elements that changed


class DeltaWeightTransfer:
    """TRL's weight-transfer protocol over a store and a fleet of vLLM servers running the plugin.

    Args:
        store: where versions are published (a local path, ``s3://``, ``http(s)://`` PUT, ``hf://``);
            the servers must be allowed to read it (``ENGINE_EXT_SOURCES``).
        servers: the servers' base URLs (``http://host:8000``).
        token: the bearer token of the servers' update route (``ENGINE_EXT_TOKEN`` on the servers).
        signing_key: the publisher's Ed25519 private key (default ``ENGINE_EXT_SIGNING_KEY``);
            the servers trust its public key (``ENGINE_EXT_TRUSTED_KEYS``).
        dtype: the served dtype the trainer's weights are cast to (fp32 masters, bf16 served; the
            publisher's ``dtype``, cast after tied names are found, so a tied embedding is sent once).
        pause_servers: ``False`` (default): ``pause``/``resume`` do nothing, since each server
            pauses itself only while it applies (milliseconds) and keeps serving while the
            version is published and fetched; ``True``: they call the servers' ``/pause``
            (mode ``keep``) and ``/resume`` (``VLLM_SERVER_DEV_MODE=1``); the update itself
            resumes generation once applied, so rollouts continue on the new weights.
        sharded: every trainer rank publishes the rows it holds (FSDP2 ``fully_shard``: ``DTensor``
            shards; :class:`~engine_ext.trainer.sharded.ShardedPublisher`, opened on every rank at the
            first :meth:`send_shards`), nothing is gathered; rank 0 pushes each committed version.
            Call :meth:`send_shards` on every rank instead of :meth:`send_weights`.
        publisher: further :class:`~engine_ext.trainer.publisher.DeltaPublisher` arguments
            (``anchor_every``, ``model``, ``resume``, ...); ``checkpoint_layout=model`` where the
            iterator's names are those of a transformers 5 model in memory (fused MoE experts, a VLM):
            :class:`DeltaGRPOTrainer` sets it to its own model.
    """

    def __init__(
        self,
        store,
        servers: Iterable[str],
        *,
        token: str | None = None,
        signing_key=None,
        dtype: torch.dtype = torch.bfloat16,
        pause_servers: bool = False,
        retries: int = 4,
        timeout_s: float = 900.0,
        sharded: bool = False,
        **publisher,
    ):
        self.sharded = sharded
        self._open = functools.partial(
            ShardedPublisher if sharded else DeltaPublisher, store, signing_key=signing_key, dtype=dtype, **publisher
        )
        self._publisher = None if sharded else self._open()  # sharded: a collective, at the first send_shards
        self.fleet = Fleet(list(servers), token, retries=retries, timeout_s=timeout_s)
        self.dtype, self.pause_servers = served_dtype(dtype), pause_servers
        self.syncs: list[SyncStats] = []
        self.last: FleetResult | None = None

    @property
    def publisher(self) -> DeltaPublisher:
        if self._publisher is None:
            self._publisher = self._open()
        return self._publisher

    # -- TRL's protocol -----------------------------------------------------------------------
    def init_weight_transfer(self) -> None:
        """Once, before the first sync: every server answers the update route (the plugin runs), and
        where the store already holds versions (a resumed run) every server is brought to its
        LATEST: a lagging one by a chain, one serving other weights by the anchor."""
        silent = [u for u in self.fleet.urls if self.fleet.status(u) is None]
        if silent:
            raise WeightSyncError(
                f"no engine_ext update route answers at {silent}: start the servers with "
                "VLLM_PLUGINS=engine_ext, and give the transfer their token"
            )
        if self.sharded:  # the publisher opens at the first sync (a collective): that push takes each server
            return  # along its route from what it holds (a chain through LATEST, or the newest anchor)
        latest = self.publisher.head.latest
        if latest is not None:
            self._push(self.publisher.store.key_uri(latest.manifest), fpr.parse(latest.fingerprint))

    def pause(self) -> None:
        self._each("/pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._each("/resume")

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> FleetResult:
        """Consume the whole iterator (FSDP gathers are collective: every parameter is taken), publish
        one version of the weights cast to the served dtype, and return once every server serves it
        with the trainer's fingerprint; :class:`WeightSyncError` names the servers that did not."""
        t0 = time.perf_counter()
        pub = self.publisher
        uri = pub.publish(iterator)  # taken whole, each tensor cast as taken (ties found on the tensors as given)
        pub.wait()
        return self._push_recorded(pub, uri, t0, published_bytes=pub.last_nbytes)

    def send_shards(self, model) -> FleetResult | None:
        """On every trainer rank (``sharded=True``): publish the rows this rank holds of ``model`` (an
        FSDP2 module's ``DTensor`` shards as they are: no ``full_tensor()``, no all-gather) as one
        version, committed by rank 0 once every rank's part is in; rank 0 then brings every server to
        it with the fingerprint of the whole model. Returns rank 0's result (None on the others). A
        version a rank failed is committed nowhere and raises :class:`WeightSyncError` on every rank
        (the servers keep the last committed version; the next one is an anchor)."""
        if not self.sharded:
            raise ValueError("send_shards needs DeltaWeightTransfer(..., sharded=True)")
        t0 = time.perf_counter()
        pub = self.publisher
        uri = publish_committed(pub, model, holders="servers")
        if pub.rank != 0:
            return None
        return self._push_recorded(pub, uri, t0, published_bytes=pub.model_nbytes)

    def _push_recorded(self, pub, uri: str, t0: float, published_bytes: int) -> FleetResult:
        """Bring every server to ``uri`` and record the sync's figures (``t0``: when publishing began)."""
        t1 = time.perf_counter()
        result = self._push(uri, pub.fingerprint)
        self.syncs.append(
            SyncStats(
                pub.version,
                max((r.fetched_bytes or 0) for r in result.replicas),
                published_bytes,
                t1 - t0,
                time.perf_counter() - t1,
                pub.last_changed / max(pub.last_numel, 1),
            )
        )
        return result

    def destroy(self) -> None:
        if self._publisher is not None:
            self._publisher.close()

    # -- helpers ------------------------------------------------------------------------------
    def _push(self, uri: str, fingerprint: int) -> FleetResult:
        self.last = self.fleet.bring(uri, fpr.fmt(fingerprint))  # WeightSyncError names each server that failed
        return self.last

    def _each(self, path: str, **kw) -> None:
        if not self.pause_servers:
            return
        for url in self.fleet.urls:
            r = self.fleet.session.post(url + path, timeout=300, **kw)
            if r.status_code != 200:
                raise WeightSyncError(f"{url}{path}: HTTP {r.status_code} {r.text[:200]} (VLLM_SERVER_DEV_MODE=1?)")


# ---------------------------------------------------------------------------------------------- GRPO


def _delta_generation_class():
    """``VLLMGeneration`` whose server-mode sync is a delta (defined once TRL is importable)."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    class DeltaVLLMGeneration(VLLMGeneration):
        """Server mode without a NCCL communicator: :meth:`sync_weights` publishes and pushes a delta."""

        def __init__(self, transfer: DeltaWeightTransfer, **kwargs):
            self.transfer = transfer
            super().__init__(**kwargs)

        def _init_vllm(self) -> None:
            if self.mode != "server":
                raise ValueError("DeltaGRPOTrainer syncs weights to vLLM servers: set vllm_mode='server'")
            if self.accelerator.is_main_process:
                base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                self.vllm_client = VLLMClient(
                    base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout
                )
                self.transfer.init_weight_transfer()
            self.accelerator.wait_for_everyone()

        def sync_weights(self) -> None:
            if self.transfer.sharded:  # every process publishes its own FSDP shards: nothing is gathered
                from accelerate.utils import is_peft_model

                if is_peft_model(self.model):
                    raise NotImplementedError(
                        "a sharded sync of a PEFT model: its adapters are merged on gathered "
                        "weights; use DeltaGRPOTrainer(delta_sharded=False)"
                    )
                self.transfer.send_shards(self.model)
                return
            params = self._iter_named_params()  # gathers are collective: every process walks them
            if self.accelerator.is_main_process:
                self.transfer.send_weights(params)  # the update resets the servers' prefix caches
            else:
                for _ in params:
                    pass

    return DeltaVLLMGeneration


@contextlib.contextmanager
def _generation_from(factory) -> Iterator[None]:
    """``GRPOTrainer.__init__`` builds its ``VLLMGeneration`` by name, with no hook: while it runs,
    the name stands for ``factory``."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original


@functools.cache
def delta_grpo_trainer_class():
    """``DeltaGRPOTrainer`` (defined on first use: importing this module does not import TRL)."""
    from trl import GRPOTrainer

    class DeltaGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer``'s own arguments, plus where versions go and who serves them.

        Args:
            delta_store: the store versions are published to (the servers' ``ENGINE_EXT_SOURCES``).
            delta_token: the bearer token of the servers' update route.
            signing_key: the publisher's Ed25519 private key (default ``ENGINE_EXT_SIGNING_KEY``).
            delta_servers: the servers' base URLs (default: ``args.vllm_server_base_url``, else
                ``http://{args.vllm_server_host}:{args.vllm_server_port}``).
            delta_dtype: the served dtype (default bfloat16).
            delta_options: more :class:`DeltaWeightTransfer` / publisher arguments.
            delta_sharded: every process publishes its own FSDP shards (:meth:`DeltaWeightTransfer.send_shards`:
                no gather; the names as the model holds them, no checkpoint-layout conversion); default: when
                ``args.fsdp`` is set or accelerate was launched with FSDP (``ACCELERATE_USE_FSDP``).

        ``args`` must say ``use_vllm=True, vllm_mode="server"``; the servers run the plugin with
        TRL's server flags (``VLLM_SERVER_DEV_MODE=1``, ``--logprobs-mode processed_logprobs``).
        ``self.weight_transfer`` holds the transfer and its per-sync figures (``syncs``).
        """

        def __init__(
            self,
            *args,
            delta_store,
            delta_token: str | None = None,
            signing_key=None,
            delta_servers: Iterable[str] | None = None,
            delta_dtype: torch.dtype = torch.bfloat16,
            delta_options: dict | None = None,
            delta_sharded: bool | None = None,
            **kwargs,
        ):
            bound = inspect.signature(GRPOTrainer.__init__).bind_partial(self, *args, **kwargs)
            config = bound.arguments.get("args")
            if config is None or not config.use_vllm or config.vllm_mode != "server":
                raise ValueError("DeltaGRPOTrainer needs args=GRPOConfig(use_vllm=True, vllm_mode='server', ...)")
            servers = list(
                delta_servers
                or [config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}"]
            )
            if delta_sharded is None:
                delta_sharded = bool(getattr(config, "fsdp", None)) or os.environ.get(
                    "ACCELERATE_USE_FSDP", ""
                ).lower() in ("1", "true")
            self.weight_transfer = DeltaWeightTransfer(
                delta_store,
                servers,
                token=delta_token,
                signing_key=signing_key,
                dtype=delta_dtype,
                sharded=delta_sharded,
                **(delta_options or {}),
            )
            generation = _delta_generation_class()
            with _generation_from(lambda **kw: generation(self.weight_transfer, **kw)):
                super().__init__(*args, **kwargs)
            pub = self.weight_transfer._publisher  # None when sharded (opened at the first sync, on every rank)
            if (
                pub is not None and pub.checkpoint_layout == "auto"
            ):  # TRL hands (name, tensor) pairs: the names of the model in memory
                pub.checkpoint_layout = transformers_model(self.model) or "auto"

        def train(self, *args, **kwargs):
            """TRL's training, then one more sync: the servers end on the trained weights (TRL syncs
            before each generation only, so its servers stop one optimizer step behind)."""
            out = super().train(*args, **kwargs)
            self.vllm_generation.sync_weights()
            return out

    return DeltaGRPOTrainer


def __getattr__(name: str):
    if name == "DeltaGRPOTrainer":
        return delta_grpo_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DeltaWeightTransfer",
    "SyncStats",
    "WeightSyncError",
    "delta_grpo_trainer_class",
]  # and DeltaGRPOTrainer, lazily
