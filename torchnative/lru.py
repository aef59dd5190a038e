"""A bounded table: every table that grows with what a process runs (graphs, sizes, traces, shapes
inferred) keeps at most its limit of entries and drops the least recently used, so a process that
runs for hours levels off (DESIGN.md §6). Dropping an entry never changes a result: what it held
is recorded, inferred or compiled again when it is needed."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Iterator

from torchnative import events

_MISSING = object()


class Lru:
    """A dict of at most `limit` entries; a lookup or a write makes an entry the most recent, and
    a write past the limit drops the least recent one (counted in `stats()["evicted"][name]`)."""
    __slots__ = ("name", "limit", "_items")

    def __init__(self, limit: int, name: str):
        self.name, self.limit = name, limit
        self._items: OrderedDict = OrderedDict()

    def get(self, key: Hashable, default: Any = None) -> Any:
        value = self._items.get(key, _MISSING)
        if value is _MISSING:
            return default
        self._items.move_to_end(key)
        return value

    def __getitem__(self, key: Hashable) -> Any:
        value = self._items[key]
        self._items.move_to_end(key)
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        self._bound()

    def setdefault(self, key: Hashable, default: Any) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            self[key] = value = default
        return value

    def pop(self, key: Hashable, default: Any = None) -> Any:
        return self._items.pop(key, default)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def values(self):
        return self._items.values()

    def items(self):
        return self._items.items()

    def clear(self) -> None:
        self._items.clear()

    def resize(self, limit: int) -> None:
        self.limit = limit
        self._bound()

    def _bound(self) -> None:
        while len(self._items) > self.limit:
            self._items.popitem(last=False)
            events.STATS.evicted[self.name] += 1
