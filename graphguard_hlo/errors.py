"""User-facing input errors: one line naming the file, the line and the problem."""

from __future__ import annotations

from typing import Optional


class InputError(Exception):
  """A mistake in what the user gave us.  The CLI prints it on one line, exit 2."""

  def __init__(self, path: Optional[str], message: str, line: Optional[int] = None,
               column: Optional[int] = None):
    self.path = path
    self.line = line
    self.column = column
    self.message = message
    super().__init__(self.one_line())

  def one_line(self) -> str:
    where = self.path or "<input>"
    if self.line is not None:
      where += f":{self.line}"
      if self.column is not None:
        where += f":{self.column}"
    msg = " ".join(self.message.split())  # never more than one line
    return f"{where}: error: {msg}"
