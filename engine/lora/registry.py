"""Which adapters an engine knows and which sit in its slots: plain bookkeeping, no tensors.

    registered  name -> Adapter (its path, its id); loaded from disk into a slot on demand
    resident    slot -> adapter; at most max_loras at once
    users       an adapter's requests in the engine (waiting or running): it is unregistered
                only once they are gone (`unregister` marks it leaving: no new requests)
    running     an adapter's admitted requests: while > 0 its slot may not be taken

When a request needs a slot and none is free, the least recently used resident adapter with
no running request gives its slot up (`claim_slot`); with none idle, the request waits.

Ids are never reused: the prefix cache namespaces KV by id (kvcache/prefix_cache.py), so an
adapter unloaded and loaded again under the same name (maybe other weights) shares nothing
with its earlier self. Id 0 is the base model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvcache.integrity import IntegrityError


@dataclass
class Adapter:
    name: str
    path: str
    id: int
    slot: int | None = None  # set by LoraRegistry
    users: int = 0  # requests in the engine; set by LoraRegistry
    running: int = 0  # of them, admitted; set by LoraRegistry
    leaving: bool = False  # unregister came while in use
    last_used: int = 0  # LoraRegistry's clock at its last admission


@dataclass
class LoraRegistry:
    max_loras: int
    adapters: dict[str, Adapter] = field(default_factory=dict)  # registered (and leaving)
    _by_id: dict[int, Adapter] = field(default_factory=dict)
    _slots: list[Adapter | None] = field(init=False)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _clock: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self):
        self._slots = [None] * self.max_loras

    def register(self, name: str, path: str) -> Adapter:
        """A new adapter; raises ValueError if `name` is taken."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded (from "
                             f"{self.adapters[name].path}); unload it first")
        adapter = Adapter(name, path, next(self._ids))
        self.adapters[name] = self._by_id[adapter.id] = adapter
        return adapter

    def lookup(self, name: str) -> Adapter | None:
        """The adapter new requests may use under `name` (not one leaving)."""
        adapter = self.adapters.get(name)
        return None if adapter is None or adapter.leaving else adapter

    def by_id(self, adapter_id: int) -> Adapter:
        return self._by_id[adapter_id]

    def get(self, adapter_id: int) -> Adapter | None:
        """The adapter of `adapter_id` if it is still registered (leaving ones included)."""
        return self._by_id.get(adapter_id)

    def unregister(self, name: str) -> Adapter | None:
        """Take `name` away from new requests. Returns the adapter if it is gone now (its
        slot, if any, is free: the caller empties it), None if its requests still run (it
        goes with the last one: `remove_user`). Raises KeyError for an unknown name."""
        adapter = self.lookup(name)
        if adapter is None:
            raise KeyError(name)
        adapter.leaving = True
        return self._drop(adapter) if adapter.users == 0 else None

    def add_user(self, adapter: Adapter) -> None:
        adapter.users += 1

    def remove_user(self, adapter: Adapter) -> Adapter | None:
        """A request of `adapter` left the engine. Returns the adapter if that was the last
        one of a leaving adapter (now dropped; the caller empties its slot)."""
        assert adapter.users > adapter.running  # a running request stops running first
        adapter.users -= 1
        return self._drop(adapter) if adapter.leaving and adapter.users == 0 else None

    def claim_slot(self, adapter: Adapter) -> tuple[int, Adapter | None] | None:
        """A slot for a non-resident adapter: a free one, else the least recently used
        resident adapter's with no running request, which is evicted (returned second).
        None if every slot's adapter is running. The caller loads the weights into it."""
        assert adapter.slot is None
        slot = next((i for i, a in enumerate(self._slots) if a is None), None)
        evicted = None
        if slot is None:
            idle = [a for a in self._slots if a.running == 0]
            if not idle:
                return None
            evicted = min(idle, key=lambda a: a.last_used)
            slot, evicted.slot = evicted.slot, None
        self._slots[slot], adapter.slot = adapter, slot
        return slot, evicted

    def start_running(self, adapter: Adapter) -> None:
        """A request of this resident adapter was admitted."""
        assert adapter.slot is not None
        adapter.running += 1
        adapter.last_used = next(self._clock)

    def stop_running(self, adapter: Adapter) -> None:
        assert adapter.running > 0
        adapter.running -= 1

    def has_free_slot(self) -> bool:
        return None in self._slots

    def resident(self) -> list[str]:
        return [a.name for a in self._slots if a is not None]

    def registered(self) -> list[str]:
        return [name for name, a in self.adapters.items() if not a.leaving]

    def _drop(self, adapter: Adapter) -> Adapter:
        del self.adapters[adapter.name]
        del self._by_id[adapter.id]
        if adapter.slot is not None:
            self._slots[adapter.slot] = None
        return adapter

    def check_integrity(self) -> None:
        for slot, a in enumerate(self._slots):
            if a is not None and (a.slot != slot or self._by_id.get(a.id) is not a):
                raise IntegrityError(f"slot {slot} holds {a.name!r} whose slot is {a.slot}")
        for a in self._by_id.values():
            if not 0 <= a.running <= a.users:
                raise IntegrityError(f"adapter {a.name!r}: running {a.running}, users {a.users}")
            if a.running and a.slot is None:
                raise IntegrityError(f"adapter {a.name!r} runs without a slot")
