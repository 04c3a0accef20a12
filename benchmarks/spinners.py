"""A bounded competing load: spinning subprocesses that always stop (standard library only).

Used by ``benchmarks/busy.py`` (the torch path against ``F.cross_entropy`` quiet and busy) and
``scripts/measure_times.py --busy N`` (the README's commands beside a competing load), which runs
without the project's virtualenv.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

# One spinner: a busy loop that ends itself at its deadline whatever happens to its parent.
SPINNER = "import time\ndeadline = time.monotonic() + {seconds}\nwhile time.monotonic() < deadline:\n    pass\n"


class Spinners:
    """``count`` busy subprocesses while the ``with`` block runs; each is stopped on exit (and ends
    itself after ``seconds`` in any case)."""

    def __init__(self, count: int, seconds: float) -> None:
        self.count, self.seconds = count, seconds
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Spinners":
        code = SPINNER.format(seconds=self.seconds)
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen([sys.executable, "-c", code]))
        except BaseException:
            self.__exit__()
            raise
        if self.procs:
            time.sleep(0.2)  # let them reach their loop
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []
