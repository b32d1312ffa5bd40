"""Decorator registries for pluggable parts (datasets, generators, losses, schedules), timm-style."""

from __future__ import annotations

from typing import Callable


def make_register(
    registry: dict[str, type], kind: str, allow_same: bool = False
) -> Callable[[str], Callable[[type], type]]:
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


def create_registered(
    registry: dict[str, type], kind: str, name: str, *, plugins: Callable[[], None] | None = None, **options
):
    """`registry[name](**options)`, with the one user-facing error for each mistake: an unknown name
    (listing the choices; `plugins()` imports modules that register more first) or options the class
    does not take (TypeError from its constructor) -> ValueError."""
    if name not in registry and plugins is not None:
        plugins()
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; choose from {sorted(registry)}")
    try:
        return registry[name](**options)
    except TypeError as exc:  # unexpected / missing keyword
        raise ValueError(f"bad options for {kind} {name!r}: {options!r} ({exc})") from exc
