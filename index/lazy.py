"""PEP 562 lazy package exports: `import pkg` loads nothing heavy until a public name is first used."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """A module-level ``__getattr__`` resolving each name in ``homes`` (name -> module) on first use."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
