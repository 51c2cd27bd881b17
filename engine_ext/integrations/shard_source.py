"""``ShardSource``: a vLLM ``WeightSource`` whose ranks publish their own shards (needs vLLM).

vLLM's trainer-side weight transfer (``vllm.distributed.weight_transfer``) takes the trainer's
weights as a ``WeightSource``: ``metadata()`` describes the whole model (full shapes, as
vLLM requires on every rank) and iteration yields full tensors, which for an FSDP model is an
all-gather per parameter (``ModuleSource`` calls ``full_tensor()``). A ShardSource is that
source, and also hands each rank's *local* rows, as they are, to a
:class:`~engine_ext.trainer.sharded.ShardedPublisher` (:meth:`ShardSource.shards`): the
``engine_ext`` backend publishes a version from every rank at once and never iterates the
source, so nothing is gathered. Any other backend given a ShardSource iterates it and gets
full tensors, as vLLM's contract says.

How the ``engine_ext`` trainer backend uses it (on every trainer rank)::

    source = ShardSource(model)                        # FSDP2 fully_shard'ed, or PP/EP with held_names
    publisher = ShardedPublisher(store, dtype=torch.bfloat16, ...)   # in trainer_init, every rank
    uri = source.publish(publisher)                    # in send_weights, every rank
    publisher.wait()                                   # every rank's part written; committed by rank 0
    if rank == 0: client.update_weights(...uri...)     # the servers fetch their cells

A source that is not a ShardSource (a plain ``ModuleSource``) is iterated on rank 0 and
published whole by a single-process DeltaPublisher, gathering as vLLM's contract says.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta

from ..trainer.checkpoint_layout import transformers_model
from ..trainer.sharded import ShardedPublisher


class ShardSource(ModuleSource):
    """``ModuleSource`` over a (sharded) module, plus :meth:`shards` for per-rank publishing.

    ``held_names``: the parameters this rank holds (pipeline or expert parallel producers; None:
    every parameter, FSDP's case, where each rank holds rows of each). ``dtype``: the dtype the
    servers load (what ``metadata()`` reports and the publisher casts to; None: as trained).
    """

    def __init__(
        self, module: torch.nn.Module, held_names: Collection[str] | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(module)
        self._held = None if held_names is None else set(held_names)
        self.dtype = dtype

    def metadata(self) -> list[ParamMeta]:
        """Every parameter of the whole model with its full shape (a DTensor's global shape: no gather)."""
        return [ParamMeta(m.name, self.dtype or m.dtype, m.shape) for m in super().metadata()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM's contract for other backends: full tensors (an all-gather per FSDP parameter), cast."""
        for name, t in super().__iter__():
            if self._held is None or name in self._held:
                yield name, t if self.dtype is None else t.to(self.dtype)

    def held_names(self) -> Collection[str] | None:
        return self._held

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameters as they are (``DTensor`` shards or whole tensors): what a
        :class:`ShardedPublisher` publishes per rank. No collective, no copy."""
        return {n: p for n, p in self._module.named_parameters() if self._held is None or n in self._held}

    def publish(self, publisher: ShardedPublisher, version: int | None = None) -> str:
        """Publish this rank's shards as the next version (call on every rank); the manifest's URI."""
        if self.dtype is not None and publisher.dtype != self.dtype:
            raise ValueError(
                f"the source serves {self.dtype}: construct the publisher with dtype={self.dtype} "
                f"(it casts to {publisher.dtype})"
            )
        if publisher.checkpoint_layout == "auto":  # the shards are a state dict: their model converts them
            publisher.checkpoint_layout = transformers_model(self._module) or "auto"
        return publisher.publish(self.shards(), version)


__all__ = ["ShardSource"]
