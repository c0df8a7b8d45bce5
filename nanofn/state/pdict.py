"""``PDict``: a persistent dict whose update costs about what a plain dict's does.

Layers of plain dicts, newest first, each built once and never written again; an update adds
a layer of its changes (a deletion is a ``_GONE`` marker), then merges the newest layers while
the newest is at least half the size of the one below it, as a binary counter carries. Each
entry is so copied O(log n) times over its life, by ``dict.update`` at C speed, and a lookup
reads at most O(log n) layers. pyrsistent's ``PMap`` costs several microseconds per ``set`` in
Python; the engine's prefix cache and live ids change every step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any


class _Gone:
    """A deleted key's value, in a layer above the one that holds the key: one object, which
    copies and pickles stay (they look it up by name)."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "_GONE"

    def __repr__(self) -> str:
        return "<deleted>"


_GONE = _Gone()
_MISSING = object()  # not in a layer (never stored)


class PDict:
    __slots__ = ("_layers", "_len")

    def __init__(self, items: Mapping | None = None):
        first = dict(items or {})
        self._layers: tuple[dict, ...] = (first,) if first else ()
        self._len = len(first)

    def get(self, key: Hashable, default: Any = None) -> Any:
        for layer in self._layers:
            value = layer.get(key, _MISSING)
            if value is not _MISSING:
                return default if value is _GONE else value
        return default

    def absent(self, keys: Iterable[Hashable]) -> set:
        """The keys that are not in the dict, found with one set intersection per layer (C
        speed, iterating the smaller side) instead of a lookup per key per layer: a key that
        is absent, like a fresh block's hash, would read every layer."""
        unresolved = set(keys)
        absent = set(unresolved)
        for layer in self._layers:
            if not unresolved:
                break
            found = layer.keys() & unresolved
            if found:
                unresolved -= found
                absent -= {k for k in found if layer[k] is not _GONE}
        return absent

    def __contains__(self, key: Hashable) -> bool:
        return self.get(key, _GONE) is not _GONE

    def __getitem__(self, key: Hashable) -> Any:
        value = self.get(key, _GONE)
        if value is _GONE:
            raise KeyError(key)
        return value

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator:
        return iter(self._merged())

    def items(self) -> Iterable[tuple[Any, Any]]:
        return self._merged().items()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PDict) and self._merged() == other._merged()

    def __repr__(self) -> str:
        return f"PDict({self._merged()!r})"

    def update(self, changes: Mapping | None = None, deletions: Iterable[Hashable] = ()) -> PDict:
        """A new PDict with ``changes`` set and ``deletions`` removed (keys not present are
        ignored); this one is left as it was."""
        layer: dict = {}
        size = self._len
        for key in deletions:
            if key in self and layer.get(key, None) is not _GONE:
                layer[key] = _GONE
                size -= 1
        for key, value in (changes or {}).items():
            if key not in self or layer.get(key, None) is _GONE:
                size += 1
            layer[key] = value
        return self._with_layer(layer, size)

    def update_known(self, added: Mapping, removed: Iterable[Hashable] = ()) -> PDict:
        """``update`` for a caller that knows ``added``'s keys are absent, unless ``removed``
        names them too (then they are replaced), and ``removed``'s present: no lookups to keep
        the length."""
        layer = dict.fromkeys(removed, _GONE)
        size = self._len - len(layer) + len(added)
        layer.update(added)
        return self._with_layer(layer, size)

    def _with_layer(self, layer: dict, size: int) -> PDict:
        if not layer:
            return self
        layers = (layer,) + self._layers
        while len(layers) > 1 and 2 * len(layers[0]) >= len(layers[1]):
            merged = dict(layers[1])
            merged.update(layers[0])
            if len(layers) == 2:  # the bottom layer holds no deletions: drop the newer one's
                for key in [k for k, v in layers[0].items() if v is _GONE]:
                    del merged[key]
            layers = (merged,) + layers[2:]
        new = object.__new__(PDict)
        new._layers = layers
        new._len = size
        return new

    def set(self, key: Hashable, value: Any) -> PDict:
        return self.update({key: value})

    def discard(self, key: Hashable) -> PDict:
        return self.update(deletions=(key,))

    def _merged(self) -> dict:
        merged: dict = {}
        for layer in reversed(self._layers):
            merged.update(layer)
        return {k: v for k, v in merged.items() if v is not _GONE}
