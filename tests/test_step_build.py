"""tools/step_build.py: a dense target's one-row gpu-mode step build timed on any machine (docs/gpu-round-profile.md,
sessions 54-55, quote it), run as a user runs it: in its own process, since it stands its kernels in for MLX's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tiny_targets import canonical_weights, config_dict, hf_names, reference_model

import mlx.core as mx

from dflash_bench.fixtures.small import write_fixture
from dflash_bench.fixtures.tokenizer import write_tokenizer

TOOL = Path(__file__).resolve().parents[1] / "tools" / "step_build.py"


def run(target: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), str(target), *args], capture_output=True, text=True, timeout=300)


def test_it_times_a_two_stream_step_on_our_kernels_with_its_layers_straight(tmp_path: Path) -> None:
    """A two-layer llama checkpoint of the default model's head layout: every projection on the row kernel, the
    layers run straight (DenseTarget.layers), a build time, and with --profile cProfile's table of our functions."""
    cfg = config_dict("llama", "smol", layers=2)
    weights = canonical_weights(reference_model(cfg, 5))
    tmp_path.joinpath("config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in hf_names(weights).items()})
    write_tokenizer(tmp_path, "llama")
    done = run(tmp_path, "--streams", "2", "--steps", "12", "--profile")
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[0]
    assert line.startswith(f"{tmp_path}: 2 stream(s), every projection on the row kernel: True, layers run straight: True")
    assert float(line.split("built in ")[1].split(" ms")[0]) > 0
    assert "dense.py" in done.stdout and "turned_decode" in done.stdout


def test_a_target_whose_heads_no_attention_launch_covers_is_refused_in_one_line(tmp_path: Path) -> None:
    """The small llama fixture's heads (4/2 of 16) have no attention launch: a usage error naming them, not a
    traceback from inside the engine."""
    target = write_fixture("llama", tmp_path / "llama")
    done = run(target, "--steps", "12")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        "attention heads 4/2 of 16: no attention launch covers them (targets/attention_kernel.py's `fits`), so its gpu "
        "mode would not run our kernels")
