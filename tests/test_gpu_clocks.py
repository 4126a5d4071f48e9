"""tools/gpu_clocks.py: nvidia-smi's query loop read beside the work (here a stand-in process printing its lines),
each line a sample at the host's time, values nvidia-smi cannot read skipped, and a summary of the samples
between two times; without the command there are no samples and the tools measure as before."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from gpu_clocks import ClockLog, parse  # noqa: E402  (tools/ is not a package)

LINES = ["1980, 2619, 350.25, 98", "[N/A], 2619, 40.00, 0", "1755, 2619, 300.00, 71", "1410, 2619, 120.50, 35"]


def test_a_line_of_the_query_loop_is_a_sample_and_anything_else_is_not() -> None:
    got = parse("1980, 2619, 350.25, 98", 5.0)
    assert (got.t, got.sm_mhz, got.mem_mhz, got.power_w, got.utilization) == (5.0, 1980.0, 2619.0, 350.25, 98.0)
    assert parse("[N/A], 2619, 40.00, 0", 5.0) is None
    assert parse("clocks.current.sm [MHz], clocks.current.memory [MHz]", 5.0) is None


def test_the_samples_between_two_times_are_summarized() -> None:
    script = "import sys, time\n" + "".join(f"print({line!r}, flush=True); time.sleep(0.05)\n" for line in LINES)
    begun = time.monotonic()
    with ClockLog(command=[sys.executable, "-c", script]) as clocks:
        deadline = time.monotonic() + 60  # a loaded machine may start the stand-in slowly: wait for its lines
        while len(clocks.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [s.sm_mhz for s in clocks.samples] == [1980.0, 1755.0, 1410.0]
    assert clocks.sm_median(begun, time.monotonic()) == 1755.0
    text = clocks.describe(begun, time.monotonic())
    assert "over 3 samples" in text and "SM 1755 MHz (1410-1980)" in text and "power 300 W" in text
    assert clocks.describe(0.0, begun) == "GPU clocks: no samples" and clocks.sm_median(0.0, begun) is None


def test_without_the_command_there_are_no_samples_and_no_error() -> None:
    with ClockLog(command=[str(Path("/nonexistent/nvidia-smi"))]) as clocks:
        pass
    assert clocks.samples == [] and clocks.describe(0.0, time.monotonic()) == "GPU clocks: no samples"
    log = ClockLog()
    log.command = None
    with log:
        pass
    assert log.describe(0.0, time.monotonic()) == "GPU clocks: no samples (no nvidia-smi)"
