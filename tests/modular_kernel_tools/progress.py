"""A dependency-free progress bar for long matrix runs (writes to stderr)."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, width: int = 30) -> None:
        # stderr as it is now, not as it was when this module was imported (a test's captured stream may be gone)
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self._draw("")

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        self._draw(note)

    def _draw(self, note: str) -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * self.width)
        elapsed = time.monotonic() - self.start
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s {note[:60]:60s}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
