"""Where KV goes: the pool's layout, and the address a receiver hands a sender."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated

from pydantic import Field

from microserve.bounds import INT32_MAX, INT64_MIN, Count
from microserve.messages.fields import CHECKED, Position, Slot, WindowIndex, WindowTag


@CHECKED
@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must agree for two engines to exchange KV pages (kvcache/transfer/).

    A tensor-parallel engine's pool is one per rank, each with the rank's share of the KV
    heads: `num_kv_heads` is a rank's (what `pool_shape` holds), `total_kv_heads` the model's.
    Engines of different tensor-parallel sizes exchange KV: a copy gathers or splits heads
    (`rank_heads` says which rank holds which)."""

    model: str
    dtype: str  # the pool's element type: float32, bfloat16, float8_e4m3fn (--kv-cache-dtype)
    page_size: Annotated[int, Field(ge=1, le=INT32_MAX)]
    num_layers: Annotated[int, Field(ge=1, le=INT32_MAX)]
    num_kv_heads: Annotated[int, Field(ge=1, le=INT32_MAX)]  # in one rank's pool
    head_dim: Annotated[int, Field(ge=1, le=INT32_MAX)]
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    total_kv_heads: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0  # the model's; 0: num_kv_heads

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        """One rank's pool."""
        return (self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    def rank_heads(self, rank: int) -> range:
        """The model's KV heads rank `rank`'s pool holds, in order: a run of them, or with
        fewer heads than ranks the one head its q heads read, replicated on size // heads
        ranks (engine/models/parallel.py cuts the weights the same way)."""
        heads, size = self.model_kv_heads, self.tensor_parallel_size
        if heads >= size:
            per = heads // size
            return range(rank * per, (rank + 1) * per)
        head = rank * heads // size
        return range(head, head + 1)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def mismatch(self, peer: KVLayout) -> str | None:
        """None if KV can move between the two layouts, else a message naming both layouts and
        what differs. How the heads are split over ranks may differ; the model's may not."""
        split = ("num_kv_heads", "tensor_parallel_size", "total_kv_heads")
        diff = [f.name for f in fields(self)
                if f.name not in split and getattr(self, f.name) != getattr(peer, f.name)]
        if self.model_kv_heads != peer.model_kv_heads:
            diff.append("total_kv_heads")
        if not diff:
            return None
        return (
            f"KV layout mismatch in {', '.join(diff)}: this engine has {self.to_dict()}, "
            f"the peer has {peer.to_dict()}"
        )


# A receiver's transfer descriptor: what a sender needs to open its pool. Its fields are its
# backend's ("kind" always; shm: pid, fd, inode, size, boot id; tcp: host, port; ...: see
# kvcache/transfer/), plain scalars, and the receiver signs them all ("mac",
# kvcache/transfer/auth.py): the sender verifies the signature before it reads any field.
TransferDescriptor = dict[str, str | bool | Annotated[int, Field(ge=INT64_MIN, le=2**64 - 1)]
                          | None]


@CHECKED
@dataclass(frozen=True, slots=True)
class KVAddr:
    """Where a receiver wants KV written: run-length ranges of its flat slots
    (slot = page * page_size + offset) covering prompt positions [begin, end) in order,
    its KV layout, its transfer descriptor, and the write window the slots belong to.

        positions:  begin ............................................ end
        ranges:     [(s0, n0),              (s1, n1),        (s2, n2)]   n0 + n1 + n2 = end - begin

    The receiver signs it whole (`mac`, over `grant()`): a sender writes only where, and only
    the KV of the tokens (`digest`, kvcache/transfer/auth.kv_digest), that the receiver
    reserved. A kv_addr is passed on as it came, never edited.
    """

    begin: Position
    end: Position
    ranges: list[tuple[Slot, Count]]
    layout: KVLayout
    transfer: TransferDescriptor
    window: tuple[WindowIndex, WindowTag]
    digest: Annotated[str, Field(max_length=128)] = ""  # hex kv_digest(prompt[:end], begin)
    mac: Annotated[str, Field(max_length=128)] = ""  # the receiver's signature over grant()

    @property
    def num_slots(self) -> int:
        return sum(n for _, n in self.ranges)

    def grant(self) -> dict:
        """What `mac` signs: every field but itself (the descriptor by its own signature)."""
        return {"begin": self.begin, "end": self.end,
                "ranges": self.ranges,
                "layout": self.layout.to_dict(), "transfer": self.transfer.get("mac"),
                "window": list(self.window), "digest": self.digest}
