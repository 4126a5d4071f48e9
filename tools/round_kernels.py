"""The device's time in one decode round, kernel by kernel: a plain round beside a drafted one.

usage (on the GPU machine, under Nsight Compute):
  ncu --clock-control none --cache-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv --log-file K.csv \
      python3 tools/round_kernels.py TARGET --drafter DRAFTER [--streams N] [--backend gpu]
  python3 tools/round_kernels.py --report K.csv

round_split.py says a drafted round is the host's or the device's; where it is the device's, this says
which kernels. The engine serves TARGET with DRAFTER; one plain request (or N) decodes a few warm
rounds, then one round (`Engine.step`: it queues the next round's work) runs inside the profiler's
range, then the same for a drafted request (the engine's warm-up is left out: the warm rounds compile
what the profiled round runs). A marker kernel launched first in the drafted range
splits the two in ncu's log. ncu runs every kernel alone, so each figure is that kernel's own time,
launch gaps left out: the device's share of a round, not the round.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import re

WARM_ROUNDS = 6
MARKER = "round_kernels_marker"


def profiled_round(engine, prompt: list[int], streams: int, draft: bool, marker=None) -> None:
    """Decode `streams` requests a few rounds, then profile one round (the marker first, if given)."""
    import mlx.core as mx

    from dflash_bench.engine.request import Request

    cuda = ctypes.CDLL("libcuda.so.1")
    for i in range(streams):
        engine.submit(Request(prompt, max_tokens=WARM_ROUNDS * 17 + 64, ignore_eos=True, seed=i, draft=draft))
    for _ in range(WARM_ROUNDS):
        engine.step()
    mx.synchronize()
    cuda.cuProfilerStart()
    if marker is not None:
        mx.eval(marker())
    engine.step()
    mx.synchronize()
    cuda.cuProfilerStop()
    while engine.lanes.busy:
        engine.step()


def run(target: str, drafter: str, streams: int, backend: str) -> None:
    import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
    import mlx.core as mx

    from dflash_bench.engine.engine import Engine, Settings

    kernel = mx.fast.cuda_kernel(name=MARKER, input_names=["x"], output_names=["y"], source="y[0] = x[0];")

    def marker() -> mx.array:
        return kernel(inputs=[mx.zeros((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                      output_shapes=[(1,)], output_dtypes=[mx.float32])[0]

    engine = Engine(target, drafter, Settings(parallel=streams, context=4096, backend=backend, warm=False))
    print(engine.startup_line(), flush=True)
    prompt = list(range(100, 356))
    profiled_round(engine, prompt, streams, draft=False)
    profiled_round(engine, prompt, streams, draft=True, marker=marker)


def kernel_kind(name: str) -> str:
    """A kernel's name without its template arguments and signature (MLX's names carry both)."""
    name = re.sub(r"<.*", "", name)
    return re.sub(r"\(.*", "", name).strip()


def report(path: str) -> None:
    """Per round: total device ms and launches, then each kernel kind's ms and launches, largest first."""
    rounds: dict[str, collections.Counter] = {"plain": collections.Counter(), "drafted": collections.Counter()}
    launches: dict[str, collections.Counter] = {k: collections.Counter() for k in rounds}
    mode = "plain"
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        kind = kernel_kind(row["Kernel Name"])
        if MARKER in kind:
            mode = "drafted"
            continue
        scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}[row["Metric Unit"]]
        rounds[mode][kind] += float(row["Metric Value"].replace(",", "")) * scale
        launches[mode][kind] += 1
    for mode, times in rounds.items():
        print(f"== {mode} round: {sum(launches[mode].values())} kernels, {sum(times.values()):.3f} ms of device time")
        for kind, ms in times.most_common():
            print(f"  {ms:8.3f} ms {launches[mode][kind]:5d}x {kind}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?")
    parser.add_argument("--drafter")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--backend", default="gpu")
    parser.add_argument("--report", metavar="CSV", help="summarize an ncu log this tool's run wrote")
    args = parser.parse_args()
    if args.report:
        report(args.report)
    elif args.target and args.drafter:
        run(args.target, args.drafter, args.streams, args.backend)
    else:
        parser.error("give TARGET and --drafter, or --report CSV")


if __name__ == "__main__":
    main()
