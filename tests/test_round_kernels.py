"""tools/round_kernels.py's report: Nsight Compute's CSV log of one plain and one drafted round, split
at the marker kernel, summed by kernel kind (template arguments dropped) in ms whatever ncu's unit."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from round_kernels import MARKER, kernel_kind, report  # noqa: E402  (tools/ is not a package)

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i: int, name: str, unit: str, value: str, metric: str = "gpu__time_duration.sum") -> str:
    return (f'"{i}","1","python3","h","{name}","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def test_kernel_kinds_drop_template_arguments_and_signatures() -> None:
    assert kernel_kind("void mlx::copy_v<float, float, unsigned int>(const T1 *, T2 *, T3)") == "void mlx::copy_v"
    assert kernel_kind("mlx::custom_kernel_dflash_rows_matmul_4096_4096_4_64_2_8_1_1") == \
        "mlx::custom_kernel_dflash_rows_matmul_4096_4096_4_64_2_8_1_1"


def test_the_report_splits_rounds_at_the_marker_and_sums_each_kind_in_ms(tmp_path, capsys) -> None:
    log = tmp_path / "k.csv"
    log.write_text("\n".join([
        "==PROF== Connected to process 1",
        HEADER,
        row(0, "void mlx::copy_v<float>(const float *)", "usecond", "2.5"),
        row(1, "void mlx::copy_v<bf16>(const bf16 *)", "ns", "1,500"),
        row(2, "void mlx::rms_norm_small<float>(float *)", "us", "10"),
        row(2, "void mlx::rms_norm_small<float>(float *)", "us", "99", metric="sm__cycles_elapsed.avg"),
        row(3, f"mlx::custom_kernel_{MARKER}", "ns", "900"),
        row(4, "void mlx::copy_v<float>(const float *)", "msecond", "0.25"),
    ]) + "\n")
    report(str(log))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== plain round: 3 kernels, 0.014 ms of device time"
    assert out[1].split() == ["0.010", "ms", "1x", "void", "mlx::rms_norm_small"]
    assert out[2].split() == ["0.004", "ms", "2x", "void", "mlx::copy_v"]
    assert out[3] == "== drafted round: 1 kernels, 0.250 ms of device time"
    assert out[4].split() == ["0.250", "ms", "1x", "void", "mlx::copy_v"]
