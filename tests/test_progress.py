"""The progress bar: drawn on terminals for long runs, never in pipes or quick runs."""

import io

from graphguard_hlo.progress import Progress


class _Tty(io.StringIO):
  def isatty(self):
    return True


def test_draws_on_a_terminal_after_the_delay_and_erases():
  out = _Tty()
  p = Progress(10, stream=out, delay=0.0)
  p.update(5)
  assert "[###############...............] 5/10 ops" in out.getvalue()
  p.close()
  assert out.getvalue().endswith("\r\033[K")


def test_silent_in_a_pipe_and_for_short_runs():
  pipe = io.StringIO()
  p = Progress(10, stream=pipe, delay=0.0)
  p.update(5)
  p.close()
  assert pipe.getvalue() == ""
  tty = _Tty()
  quick = Progress(10, stream=tty, delay=60.0)
  quick.update(5)
  quick.close()
  assert tty.getvalue() == ""
