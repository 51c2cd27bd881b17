"""The two messages that carry an update op from SGLang's TokenizerManager to every
TP rank's scheduler and the combined answer back.

They travel on SGLang's own ZMQ channels (tokenizer -> scheduler rank 0 ->
broadcast to every TP rank; rank 0 -> tokenizer) inside SGLang's ``PickleWrapper``,
the envelope SGLang 0.5.23 provides for payloads that are not one of its msgspec
structs (``sglang.srt.managers.io_struct.wrap_as_pickle``), so neither SGLang's
msgpack decoder nor its type registry has to know them. Plain dataclasses of plain
data: importable from every process, nothing to unpickle but dicts and strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankOpReq:
    """Run ``op`` of :class:`engine_ext.server.rank.RankUpdater` (or a scheduler op) on every TP rank."""

    op: str
    kwargs: dict = field(default_factory=dict)


@dataclass
class RankOpReply:
    """One reply per TP rank, in rank order (gathered on the scheduler side)."""

    replies: list = field(default_factory=list)
