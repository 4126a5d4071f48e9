"""tests/cuda_emulator.py's guard pages: the kernel-source tests that run on a CPU (test_attention_kernel.py,
test_delta_kernel.py, test_matmul_kernel.py) stay silent about an access past a buffer only if there is none."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import cuda_emulator

TESTS = Path(__file__).resolve().parent
# A kernel of 32 threads, each writing its element of y shifted by OFFSET: 1 writes one past y's end.
SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import dflash_bench
import mlx.core as mx
import cuda_emulator
kernel = cuda_emulator.Emu("shifted", ["x"], ["y"], "  const int i = threadIdx.x; y[i + {offset}] = x[i] * 2.0f;", "")
(y,) = kernel(inputs=[mx.arange(33, dtype=mx.float32)], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32 + {grow},)],
              output_dtypes=[mx.float32])
print(y[1:33].sum().item())
"""


def run(offset: int, grow: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(TESTS), offset=offset, grow=grow)],
                          capture_output=True, text=True, timeout=300)


@cuda_emulator.needs_gxx
def test_a_write_past_an_output_faults_and_the_same_write_inside_a_bigger_one_does_not() -> None:
    inside = run(offset=1, grow=4)  # y has 36 elements: the shifted write stays inside
    assert inside.returncode == 0, inside.stderr[-2000:]
    assert float(inside.stdout.split()[-1]) == 2 * sum(range(32))
    past = run(offset=1, grow=0)  # y has 32: thread 31 writes y[32]
    assert past.returncode == -signal.SIGSEGV, (past.returncode, past.stderr[-2000:])
