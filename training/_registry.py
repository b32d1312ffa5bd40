"""Decorator registries for pluggable parts (datasets, generators, losses, schedules), timm-style."""
from __future__ import annotations

from typing import Callable


def make_register(registry: dict[str, type], kind: str,
                  allow_same: bool = False) -> Callable[[str], Callable[[type], type]]:
    """Return `register(name)`: a class decorator that sets `cls.name` and adds `cls` to `registry`.

    A name may be registered once; with `allow_same`, registering the same class again (a module
    reload) is accepted."""
    def register(name: str) -> Callable[[type], type]:
        def deco(cls: type) -> type:
            if name in registry and not (allow_same and registry[name] is cls):
                raise ValueError(f"{kind} {name!r} is already registered")
            cls.name = name
            registry[name] = cls
            return cls
        return deco
    return register
