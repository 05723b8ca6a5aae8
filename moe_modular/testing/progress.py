"""A dependency-free progress bar for long matrix runs (writes to stderr): done / total, elapsed time, an
estimate of the time left (from the mean time per step so far) and the whole name of the last step."""
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
        self._last_len = 0
        self._draw("")

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        self._draw(note)

    def _draw(self, note: str) -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * self.width)
        elapsed = time.monotonic() - self.start
        bar = "#" * filled + "." * (self.width - filled)
        left = f"~{elapsed / self.done * (self.total - self.done):.0f}s left" if self.done else "estimating"
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:.0f}s, {left}  {note}"
        # pad over the previous line where this one is shorter (the names vary in length)
        self.stream.write("\r" + line + " " * max(0, self._last_len - len(line)))
        self._last_len = len(line)
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
