"""tools/round_timeline.py's reading of a PyTorch profiler trace: the device's busy time a round is the union
of its kernels' intervals between the first marked round's start and the next-to-last's end, idle time is
binned by gap length and put to the innermost host phase open over it, and kernels outside the span or GPU
echoes of the host's marks are left out."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from round_timeline import (  # noqa: E402  (tools/ is not a package)
    OUTSIDE, PHASE_LABELS, ROUND, Interval, calls_by_name, describe, describe_calls, describe_idle,
    describe_instantiations, describe_longest, host_pieces, idle_by_phase, instantiations, longest, read_trace,
    report, summarize)


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def mark(ts: float, dur: float, cat: str = "user_annotation", name: str = ROUND) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_busy_time_is_the_union_of_kernels_and_gaps_are_binned_by_length(tmp_path) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        mark(1000, 900), mark(2000, 900), mark(3000, 900),  # three marked rounds: the span is 1000..3000
        mark(1000, 900, cat="gpu_user_annotation"),  # the GPU track's echo of a mark: not a round
        kernel("void mlx::copy_v<float>(const float *)", 900, 50),  # starts before the span: left out
        kernel("mlx::custom_kernel_dflash_rows_matmul_4096_4096_4_64_2_8_1_1", 1000, 400),
        kernel("void mlx::copy_v<float>(const float *)", 1200, 100),  # inside the one before: no busy time of its own
        kernel("void mlx::copy_v<bf16>(const bf16 *)", 1350, 100),  # overlaps its end: 50 us more
        kernel("mlx::custom_kernel_dflash_rows_matmul_4096_4096_4_64_2_8_1_1", 1455, 45),  # a 5 us gap
        kernel("void mlx::rms_norm_small<float>(float *)", 1550, 450),  # a 50 us gap
        kernel("mlx::custom_kernel_dflash_rows_matmul_4096_4096_4_64_2_8_1_1", 2500, 600),  # a 500 us gap
        kernel("void mlx::copy_v<float>(const float *)", 3000, 10),  # starts at the span's end: left out
        {"ph": "i", "name": "instant", "ts": 1500},  # not a duration event
    ]}))
    kernels, rounds, phases, calls = read_trace(str(trace))
    assert [r.start for r in rounds] == [1000, 2000, 3000] and phases == [] and calls == []
    t = summarize(kernels, rounds)
    assert t.rounds == 2 and t.wall_ms == 1.0
    assert t.busy_ms == pytest.approx((450 + 45 + 450 + 600) / 2 / 1e3)
    assert t.kernels == 3.0
    assert t.gaps_ms == pytest.approx({"< 10 us": 0.0025, "10-100 us": 0.025, ">= 100 us": 0.25})
    # busy and idle together reach from the first counted kernel's start to the last one's end
    assert t.busy_ms + sum(t.gaps_ms.values()) == pytest.approx((3100 - 1000) / 2 / 1e3)
    matmul = "mlx::custom_kernel_dflash_rows_matmul_4096_4096_4_64_2_8_1_1"
    assert t.kinds[0] == (matmul, pytest.approx(0.5225), 1.5)
    assert dict((k, n) for k, _, n in t.kinds) == {matmul: 1.5, "void mlx::rms_norm_small": 0.5, "void mlx::copy_v": 1.0}
    assert describe("drafted", t).startswith("== drafted: 2 rounds, 1.00 ms a round; the device busy 0.77 ms (77%)")


def test_a_trace_with_too_few_marked_rounds_is_refused() -> None:
    with pytest.raises(ValueError, match="need 3 marked rounds, got 2"):
        summarize([Interval("k", 0, 1)], [Interval(ROUND, 0, 1), Interval(ROUND, 2, 3)], 2)


def test_idle_time_goes_to_the_innermost_host_phase_open_over_it(tmp_path) -> None:
    """Two rounds of 1000 us: in the first the host builds a forward (1000-1400), then MLX encodes in async_eval
    (1400-1800) with a keep inside it (1500-1550, innermost there), then nothing marked but the round; the second
    round reads (2000-2300). Kernels run 1600-1700 and 2200-2900, so the device idles 1000-1600, 1700-2200 and
    2900-3000, and each stretch is split by what the host was in."""
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        mark(1000, 900), mark(2000, 900), mark(3000, 900),
        mark(1000, 400, name="forward"), mark(1400, 400, name="async_eval"), mark(1500, 50, name="keep"),
        mark(2000, 300, name="read"), mark(2000, 300, cat="gpu_user_annotation", name="read"),  # an echo: left out
        kernel("void mlx::copy_v<float>(const float *)", 1600, 100),
        kernel("void mlx::copy_v<float>(const float *)", 2200, 700),
    ]}))
    kernels, rounds, phases, _ = read_trace(str(trace))
    assert sorted(p.name for p in phases) == ["async_eval", "forward", "keep", "read"]
    spent = idle_by_phase(kernels, rounds, phases)
    # forward 1000-1400; async_eval 1400-1500, 1550-1600 and 1700-1800; keep 1500-1550; the round alone
    # 1800-1900; no mark 1900-2000 and 2900-3000 (a round's mark lasts 900 us); read 2000-2200. Two rounds:
    # halved, in ms.
    assert spent == pytest.approx({"forward": 0.2, "async_eval": 0.125, "keep": 0.025, ROUND: 0.05,
                                   OUTSIDE: 0.1, "read": 0.1})
    assert sum(spent.values()) == pytest.approx((3000 - 1000 - 100 - 700) / 2 / 1e3)
    assert list(spent)[0] == "forward"  # most first
    assert describe_idle(spent).startswith("  idle while the host was in: forward 0.20 ms, ")
    assert "the round, in no phase 0.05 ms" in describe_idle(spent)


def test_the_phase_labels_read_back_are_those_round_split_wraps() -> None:
    import round_split

    assert sorted(set(PHASE_LABELS)) == sorted({label for label, _, _ in round_split.PHASES})


def test_host_pieces_follow_nested_marks_and_cut_a_child_at_its_parents_end() -> None:
    marks = [Interval("a", 0, 100), Interval("b", 10, 30), Interval("c", 20, 25), Interval("d", 90, 120),
             Interval("e", 200, 210)]
    assert host_pieces(marks) == [Interval("a", 0, 10), Interval("b", 10, 20), Interval("c", 20, 25),
                                  Interval("b", 25, 30), Interval("a", 30, 90), Interval("d", 90, 100),
                                  Interval("e", 200, 210)]


def test_the_hosts_cuda_calls_are_summed_by_name_inside_the_span(tmp_path) -> None:
    call = lambda name, ts, dur, cat="cuda_runtime": {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        mark(1000, 900), mark(2000, 900), mark(3000, 900),
        call("cudaGraphLaunch", 900, 5),  # before the span: left out
        call("cudaGraphInstantiate", 1100, 300), call("cudaGraphLaunch", 1400, 10),
        call("cudaGraphExecUpdate", 2100, 40), call("cudaGraphLaunch", 2200, 10),
        call("cuLaunchKernel", 2300, 6, cat="cuda_driver"),
        call("cudaGraphLaunch", 3000, 10),  # at the span's end: left out
        kernel("void mlx::copy_v<float>(const float *)", 1500, 10),  # a kernel, not a call
    ]}))
    _, rounds, _, made = read_trace(str(trace))
    calls = calls_by_name(made, rounds)
    assert calls == [("cudaGraphInstantiate", pytest.approx(0.15), 0.5), ("cudaGraphExecUpdate", pytest.approx(0.02), 0.5),
                     ("cudaGraphLaunch", pytest.approx(0.01), 1.0), ("cuLaunchKernel", pytest.approx(0.003), 0.5)]
    assert describe_calls(calls).splitlines()[1] == "     0.150 ms     0.5x cudaGraphInstantiate"


def test_each_graph_instantiation_is_placed_in_its_round_and_host_phase(tmp_path) -> None:
    call = lambda name, ts, dur: {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        mark(1000, 900), mark(2000, 900), mark(3000, 900), mark(4000, 900),
        mark(1100, 400, name="async_eval"), mark(3050, 100, name="forward"),
        call("cudaGraphInstantiate", 900, 50),  # before the span: left out
        call("cudaGraphInstantiate", 1200, 300), call("cudaGraphExecUpdate", 1600, 40),
        call("cudaGraphInstantiate", 3060, 20), call("cudaGraphInstantiate", 3500, 1000),
        call("cudaGraphInstantiate", 4100, 10),  # in the last marked round, which ends the span: left out
    ]}))
    _, rounds, phases, made = read_trace(str(trace))
    found = instantiations(made, rounds, phases)
    assert found == [(0, "async_eval", 0.3), (2, "forward", 0.02), (2, "the round, in no phase", 1.0)]
    assert describe_instantiations(found) == ("  graph instantiations (round, host phase, ms): 0 async_eval 0.30, "
                                              "2 forward 0.02, 2 the round, in no phase 1.00")
    assert describe_instantiations(instantiations(made, rounds, phases, 1)) == (
        "  graph instantiations (round, host phase, ms): 0 async_eval 0.30")
    assert describe_instantiations([]) == "  graph instantiations: none"


def test_held_writes_keep_mlx_from_donating_a_caches_buffer_and_change_no_value() -> None:
    """`--writes held`: a cache write whose input nothing else holds updates the buffer in place (MLX donates it);
    under held_writes the same write copies into a new buffer, and the cache holds the same values: a layer's
    cache's write and a dense target's every-layer one."""
    import mlx.core as mx
    from buffers import address

    from dflash_bench.engine.cache import JointCache
    from dflash_bench.engine.stacked_cache import StackedState
    from round_timeline import held_writes

    def written(hold: bool) -> tuple[bool, mx.array]:
        cache = JointCache(2, 8)
        rows = mx.arange(2 * 2 * 3 * 8, dtype=mx.float32).reshape(2, 2, 3, 8)
        cache.write_joint(0, rows)  # grows the cache: a new buffer either way
        mx.eval(cache.kv)
        mx.synchronize()
        before = address(cache.kv)
        with held_writes() if hold else contextlib.nullcontext():
            cache.write_joint(3, rows[:, :, :1] + 100)
        mx.eval(cache.kv)
        return address(cache.kv) == before, cache.kv

    in_place, kv = written(hold=False)
    copied_in_place, held_kv = written(hold=True)
    assert in_place and not copied_in_place
    assert mx.array_equal(kv, held_kv).item() and kv[0, 0, 3, 0].item() == 100.0

    def stack_written(hold: bool, one_layer: bool) -> tuple[bool, mx.array]:
        """A dense target's every-layer write (stacked_cache.py), or one layer's (a prompt chunk's)."""
        state = StackedState(2, 2, 8)
        rows = mx.arange(4 * 2 * 3 * 8, dtype=mx.float32).reshape(4, 2, 3, 8)
        state.write_layers(0, rows)
        mx.eval(state.stack.kv)
        mx.synchronize()
        before = address(state.stack.kv)
        if not one_layer:
            state.write_layers(3, rows[:, :, :1] + 100)
        with held_writes() if hold else contextlib.nullcontext():
            if one_layer:
                state.layers[0].write_joint(3, rows[:2, :, :1] + 100)
            mx.eval(state.stack.kv)  # (the read that writes every layer's rows)
        return address(state.stack.kv) == before, state.stack.kv

    for one_layer in (False, True):
        in_place, kv = stack_written(False, one_layer)
        copied_in_place, held_kv = stack_written(True, one_layer)
        assert in_place and not copied_in_place, one_layer
        assert mx.array_equal(kv, held_kv).item() and kv[0, 0, 3, 0].item() == 100.0


def test_the_longest_launches_in_the_span_are_listed_with_their_grids(tmp_path) -> None:
    trace = tmp_path / "t.json"
    big = dict(kernel("void mlx::core::cu::copy_v<bf16>(const bf16 *)", 1500, 400), args={"grid": [4096, 1, 1]})
    trace.write_text(json.dumps({"traceEvents": [
        mark(1000, 900), mark(2000, 900), mark(3000, 900),
        kernel("void mlx::core::cu::copy_v<bf16>(const bf16 *)", 500, 900),  # before the span: left out
        big, kernel("mlx::core::cu::custom_kernel_dflash_rows_matmul_1_2_3", 2100, 50),
        kernel("void mlx::core::cu::rms_norm_small", 2200, 5),
    ]}))
    kernels, rounds, _, _ = read_trace(str(trace))
    found = longest(kernels, rounds, top=2)
    assert [(k.start, k.grid) for k in found] == [(1500, (4096, 1, 1)), (2100, ())]
    assert describe_longest(found).splitlines() == [
        "  the longest launches:",
        "     0.400 ms grid     4096x1x1 void mlx::core::cu::copy_v",
        "     0.050 ms grid            ? mlx::core::cu::custom_kernel_dflash_rows_matmul_1_2_3"]
    ours = kernel("mlx::core::cu::custom_kernel_dflash_rows_matmul_1_2_3", 2300, 600)  # longer than the copy
    trace.write_text(json.dumps({"traceEvents": [mark(1000, 900), mark(2000, 900), mark(3000, 900), big, ours,
                                                 kernel("void mlx::core::cu::rms_norm_small", 2200, 5)]}))
    kernels, rounds, _, _ = read_trace(str(trace))
    assert [k.start for k in longest(kernels, rounds, top=2)] == [2300, 1500]
    mlx = longest(kernels, rounds, top=2, mlx_only=True)
    assert [k.start for k in mlx] == [1500, 2200]
    assert describe_longest(mlx, "launches of MLX's own kernels").splitlines()[0] == \
        "  the longest launches of MLX's own kernels:"


def test_a_report_gives_every_section_once_in_order(tmp_path) -> None:
    """`report`, what `run` prints for each mode and `--report` for an earlier trace: the summary, then the idle time
    by phase, the host's calls, the instantiations, the longest launches and the longest of MLX's own."""
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        mark(1000, 900), mark(2000, 900), mark(3000, 900),
        kernel("void mlx::core::cu::copy_v<bf16>(const bf16 *)", 1500, 400),
        kernel("mlx::core::cu::custom_kernel_dflash_rows_matmul_1_2_3", 2100, 50)]}))
    kernels, rounds, phases, calls = read_trace(str(trace))
    t, text = report("plain", kernels, rounds, phases, calls, None)
    assert t == summarize(kernels, rounds, None)
    heads = ["== plain:", "  idle while the host was in:", "  the host's CUDA API calls a round:", "  graph instantiations:",
             "  the longest launches:", "  the longest launches of MLX's own kernels:"]
    at = [next(i for i, line in enumerate(text.splitlines()) if line.startswith(h)) for h in heads]
    assert at == sorted(at)
    assert text.splitlines()[-1].endswith("void mlx::core::cu::copy_v")  # ours is not among MLX's own
