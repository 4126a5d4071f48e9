"""The GPU's clocks while a tool measures, from nvidia-smi's query loop beside the work.

In session 48's round timelines the row kernel's launches took 1.5-3x their alone times (the 9B's o 28 us a
launch against 8.9 alone at one row, down 42 against 19.8: docs/gpu-round-profile.md), and under Nsight Compute
the one-row launch issues instructions at about half the rate a scheduler could: such a launch's time follows the
SM clock. The tools' alone timings keep the device busy back to back; an engine's rounds leave it idle 25-35% of
the time. `ClockLog` records the SM and memory clocks, power and utilization while the work runs, so the timeline
(tools/round_timeline.py) and the alone timings (tools/row_kernel_variants.py) each say at what clock they ran.

ClockLog runs `nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader,nounits
--loop-ms=MS` and keeps each sample with the host's monotonic time; `describe(t0, t1)` summarizes the samples between
two such times. Without nvidia-smi (or where it fails) there are no samples, and `describe` says so: the tools
measure as before.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

QUERY = "clocks.sm,clocks.mem,power.draw,utilization.gpu"


@dataclass(frozen=True)
class Sample:
    t: float  # the host's time.monotonic() when the line was read
    sm_mhz: float
    mem_mhz: float
    power_w: float
    utilization: float  # percent of the sample period a kernel ran


def parse(line: str, t: float) -> Sample | None:
    """One line of the query loop, or None for anything else (a value nvidia-smi cannot read is "[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return Sample(t, *(float(p) for p in parts))
    except ValueError:
        return None


class ClockLog:
    """nvidia-smi's query loop in a process beside the work, its samples read by a thread (a context manager)."""

    def __init__(self, interval_ms: int = 20, command: list[str] | None = None):
        smi = shutil.which("nvidia-smi")
        self.command = command or ([smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"]
                                   if smi else None)
        self.samples: list[Sample] = []
        self.proc: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None

    def __enter__(self) -> ClockLog:
        if self.command:
            try:
                self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self.proc = None
        if self.proc is not None:
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            sample = parse(line, time.monotonic())
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.reader.join()

    def between(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.samples if t0 <= s.t <= t1]

    def sm_median(self, t0: float, t1: float) -> float | None:
        """The SM clock's median between t0 and t1 (MHz), None without samples there."""
        got = self.between(t0, t1)
        return statistics.median(s.sm_mhz for s in got) if got else None

    def describe(self, t0: float, t1: float) -> str:
        """The samples between t0 and t1: the SM clock's median and range, the memory clock, power and
        utilization's medians."""
        got = self.between(t0, t1)
        if not got:
            return "GPU clocks: no samples" + ("" if self.command else " (no nvidia-smi)")
        sm = [s.sm_mhz for s in got]
        return (f"GPU clocks over {len(got)} samples: SM {statistics.median(sm):.0f} MHz ({min(sm):.0f}-{max(sm):.0f}), "
                f"memory {statistics.median(s.mem_mhz for s in got):.0f} MHz, "
                f"power {statistics.median(s.power_w for s in got):.0f} W, "
                f"utilization {statistics.median(s.utilization for s in got):.0f}%")
