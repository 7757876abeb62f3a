"""``run.jobs.exit_process``: a finished run's fast exit still does what a normal exit does."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_exit_process_runs_atexit_flushes_and_keeps_the_status(tmp_path: Path) -> None:
    """The ``atexit`` handlers run (here: one writing a file, and logging's own shutdown, which
    flushes a file handler), buffered stdout and stderr reach the parent, and the status is the one
    given; nothing after the call runs (``os._exit``)."""
    marker, logged = tmp_path / "atexit", tmp_path / "log.txt"
    code = textwrap.dedent(
        f"""
        import atexit, logging, sys
        from pathlib import Path
        from nodetrain.run.jobs import exit_process

        atexit.register(lambda: Path({str(marker)!r}).write_text("ran"))
        handler = logging.FileHandler({str(logged)!r})
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("t").addHandler(handler)
        logging.getLogger("t").warning("a line the handler buffers until it is flushed")
        sys.stdout.write("no newline, still buffered")
        sys.stderr.write("on stderr")
        exit_process(3)
        print("unreachable")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "no newline, still buffered" and proc.stderr.endswith("on stderr")
    assert marker.read_text() == "ran"
    assert logged.read_text() == "a line the handler buffers until it is flushed\n"
