"""One run's lifecycle, shared by every command that writes a receipt.

Whatever ends a run (it finishing, a bug, the server dying, Ctrl-C, SIGTERM from a job runner or a
timeout) the receipt is written, atomically, marked incomplete with the reason unless the body
finished; the exit code then says which (receipt.exit_code: 0 passed, 1 failed, 2 incomplete, 130
interrupted). The checks (runner.run_check), `suite`, `plan --check`, `engine-speed` and
`selfcheck` all run inside `receipt_run`, so they cannot differ in how they stop.
"""

from __future__ import annotations

import signal
import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from dflash_bench.checks.receipt import Receipt, exit_code
from dflash_bench.engine.errors import DFlashBenchError


@dataclass
class RunState:
    """What the `with` body may set, and what the run ended as (`code`, once the block is left)."""

    receipt: Receipt
    path: Path
    before_write: list[Callable[[], None]] = field(default_factory=list)  # run in order, just before writing
    interrupted: bool = False
    code: int | None = None


def describe(err: BaseException) -> str:
    """The incomplete_reason of an exception: a DFlashBenchError's own line, else its type and message."""
    return err.line() if isinstance(err, DFlashBenchError) else f"{type(err).__name__}: {err}"


@contextmanager
def receipt_run(receipt: Receipt, path: Path, expected: tuple[type[BaseException], ...] = (DFlashBenchError,),
                reason: Callable[[BaseException], str] = describe) -> Iterator[RunState]:
    """Runs the `with` body; the exception that ends it is kept in the receipt, not raised.

    `expected` exceptions (the run's own failures: a refused model, the server gone) need no traceback;
    any other is a bug, and its traceback goes to stderr as well. A body that finished marks the
    receipt complete unless it called receipt.finish itself. SIGTERM is taken as Ctrl-C while inside.
    """
    state = RunState(receipt, Path(path))
    previous = _term_as_interrupt()
    try:
        yield state
        if not receipt.finished_at:
            receipt.finish(True)
    except KeyboardInterrupt as err:
        state.interrupted = True
        receipt.finish(False, f"interrupted ({str(err) or 'Ctrl-C'})")
    except Exception as err:
        if not isinstance(err, expected):
            traceback.print_exc()
        receipt.finish(False, reason(err))
    finally:
        if not receipt.finished_at:  # a BaseException such as SystemExit passing through
            receipt.finish(False, "stopped before the run finished")
        try:
            for hook in state.before_write:
                hook()
        finally:
            receipt.write(state.path)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    state.code = exit_code(receipt, state.interrupted)


def _term_as_interrupt():
    """SIGTERM (a timeout, a job runner stopping us) ends the run as Ctrl-C does: receipt written,
    marked incomplete. Returns the previous handler (None off the main thread, where it cannot be set)."""
    def handler(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)
