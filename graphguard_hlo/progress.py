"""A one-line progress bar on stderr for long runs.

Shown only on a terminal, only once a run has taken ``delay`` seconds (short runs
stay quiet), redrawn at most ten times a second, erased when done.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
  def __init__(self, total: int, label: str = "verifying", stream: Optional[TextIO] = None,
               enabled: Optional[bool] = None, delay: float = 2.0):
    self.stream = stream or sys.stderr
    self.total = max(total, 1)
    self.label = label
    self.enabled = self.stream.isatty() if enabled is None else enabled
    self.delay = delay
    self.start = time.monotonic()
    self._last_draw = 0.0
    self.drawn = False

  def update(self, done: int) -> None:
    if not self.enabled:
      return
    now = time.monotonic()
    if now - self.start < self.delay or now - self._last_draw < 0.1:
      return
    self._last_draw = now
    width = 30
    filled = int(width * min(done, self.total) / self.total)
    self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                      f"{done}/{self.total} ops {now - self.start:5.1f}s")
    self.stream.flush()
    self.drawn = True

  def close(self) -> None:
    if self.drawn:
      self.stream.write("\r\033[K")
      self.stream.flush()
