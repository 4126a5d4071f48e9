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
    receipt complete unless it called receipt.finish itself. SIGTERM is taken as Ctrl-C while inside, and
    either signal is remembered (`interrupt_pending`): Python drops an exception raised while a generator
    is being finalized (an HTTP stream closing, say), so a run whose interrupt was dropped that way still
    ends as interrupted, at the client's next chunk or request or else when the body returns.
    """
    state = RunState(receipt, Path(path))
    previous = _signals_as_interrupt()
    try:
        yield state
        interrupt_pending()
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
            _pending.clear()
            for signum, handler in (previous or {}).items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
    state.code = exit_code(receipt, state.interrupted)


_pending: list[str] = []  # the signals received inside a run, by name, until it ends


def interrupt_pending() -> None:
    """Raises KeyboardInterrupt again for a signal the run received whose own raise was dropped (`receipt_run`);
    nothing when none came. The HTTP client asks between chunks and before each request (checks/client.py)."""
    if _pending:
        raise KeyboardInterrupt(_pending[0])


def _signals_as_interrupt() -> dict[int, object] | None:
    """SIGTERM (a timeout, a job runner stopping us) ends the run as Ctrl-C does: receipt written, marked
    incomplete; each signal is also remembered (`interrupt_pending`). Returns the previous handlers (None off
    the main thread, where none can be set)."""
    def handler(signum, frame):
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        _pending.append(name)
        raise KeyboardInterrupt(name)

    if threading.current_thread() is not threading.main_thread():
        return None
    _pending.clear()
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    if previous[signal.SIGINT] == signal.SIG_IGN:  # a background job's Ctrl-C is not ours to take
        del previous[signal.SIGINT]
    for signum in previous:
        signal.signal(signum, handler)
    return previous
