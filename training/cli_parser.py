"""The argument parser every `softsearch` command builds: a mistyped flag is one `error:` line and exit 2.

Lives in training (the lowest layer) and imports only the standard library, so each command can build
and check its arguments before it loads torch, FAISS or open_clip.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class CommandParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block); --help is unchanged. Sub-parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message} (`{self.prog} --help` lists the options)", file=sys.stderr)
        sys.exit(2)
