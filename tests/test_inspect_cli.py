"""`dflash-bench inspect`: tables from configs and headers, or the refusal as one line with exit 1."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_bench.cli import app

PUBLISHED = Path(__file__).parent / "data" / "published"


def invoke(*args: str):
    """Run `dflash-bench inspect ARGS`."""
    return CliRunner().invoke(app, ["inspect", *args], env={"COLUMNS": "200"})


@pytest.fixture
def folders(tmp_path: Path):
    """A target folder (Qwen3.5-4B's config.json) and a drafter folder, configs only, no weights."""

    def make(drafter: str) -> tuple[Path, Path]:
        target, draft = tmp_path / "Qwen3.5-4B", tmp_path / "drafter"
        target.mkdir(exist_ok=True)
        draft.mkdir(exist_ok=True)
        (target / "config.json").write_text((PUBLISHED / "qwen3.5-4b.config.json").read_text())
        (draft / "config.json").write_text((PUBLISHED / f"{drafter}.config.json").read_text())
        return target, draft

    return make


def test_inspect_shows_target_and_v1_drafter(folders) -> None:
    target, drafter = folders("qwen3.5-4b-dflash")
    result = invoke(str(target), "--drafter", str(drafter))
    assert result.exit_code == 0, result.output
    out = result.stdout
    for shown in ("qwen3_5", "24 linear + 8 full", "16 / 4", "256", "248320", "bfloat16", "DFlash",
                  "1, 5, 9, 13, 17, 21, 25, 29", "248077", "5 sliding + 1 full (window 4096)",
                  "causal in block: layers 0, 1, 2, 3, 4", "bidirectional: layers 5", "69"):
        assert shown in out, shown


def test_inspect_json_is_one_object(folders) -> None:
    target, drafter = folders("qwen3.5-4b-dflash")
    result = invoke(str(target), "--drafter", str(drafter), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["target"]["layer_kinds"] == "24 linear + 8 full"
    assert report["target"]["heads"] == "16 / 4" and report["target"]["hidden_size"] == 2560
    assert report["target"]["weight_bytes"] is None
    d = report["drafter"]
    assert (d["kind"], d["taps"], d["block_size"], d["mask_token_id"]) == ("DFlash", [1, 5, 9, 13, 17, 21, 25, 29], 16, 248077)
    assert d["expected_tensors"] == 69 and d["tensors"] is None


def test_inspect_target_alone(folders) -> None:
    target, _ = folders("qwen3.5-4b-dflash")
    result = invoke(str(target), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["drafter"] is None


def test_refusal_is_one_line_on_stderr_with_exit_1(folders) -> None:
    target, drafter = folders("qwen3.8-27b-dflash2")
    result = invoke(str(target), "--drafter", str(drafter))
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (
        "DraftForAnotherTarget: dflash_config.target_layer_ids holds 33 in the drafter, the target has 32 layers\n"
    )


def test_refusal_needs_no_weights_and_reads_none(folders) -> None:
    target, drafter = folders("qwen3.8-27b-dflash2")
    assert not list(drafter.glob("*.safetensors"))
    assert invoke(str(target), "--drafter", str(drafter)).stderr.startswith("DraftForAnotherTarget:")
    (drafter / "model.safetensors").write_bytes(b"\xff" * 16)  # unreadable if anything tried
    result = invoke(str(target), "--drafter", str(drafter), "--json")
    assert result.exit_code == 1
    assert result.stderr.startswith("DraftForAnotherTarget:") and result.stderr.count("\n") == 1


def _header_only(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A safetensors header describing bf16 tensors, their data a sparse hole of the right size (a
    file shorter than its header says is refused as truncated; the hole takes no disk)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * math.prod(shape)]}
        offset = header[name]["data_offsets"][1]
    raw = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def test_drafter_tensors_are_counted_from_the_header(folders) -> None:
    from dflash_bench.engine.draft_config import read_draft_config
    from dflash_bench.engine.inventory import expected_inventory

    target, drafter = folders("qwen3.5-4b-dflash")
    _header_only(drafter / "model.safetensors", expected_inventory(read_draft_config(drafter)))
    result = invoke(str(target), "--drafter", str(drafter), "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)["drafter"]
    assert (d["tensors"], d["weight_bytes"]) == (69, 2 * 634_425_856)


def test_drafter_header_that_misses_a_tensor_is_refused(folders) -> None:
    from dflash_bench.engine.draft_config import read_draft_config
    from dflash_bench.engine.inventory import expected_inventory

    target, drafter = folders("qwen3.5-4b-dflash")
    shapes = expected_inventory(read_draft_config(drafter))
    del shapes["norm.weight"]
    _header_only(drafter / "model.safetensors", shapes)
    result = invoke(str(target), "--drafter", str(drafter))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"CheckpointError: {drafter}: DFlash drafter checkpoint has no tensor 'norm.weight'")


def test_malformed_drafter_config_is_one_line(folders) -> None:
    target, drafter = folders("qwen3.5-4b-dflash")
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["hidden_size"] = "2560"
    (drafter / "config.json").write_text(json.dumps(cfg))
    result = invoke(str(target), "--drafter", str(drafter))
    assert result.exit_code == 1
    assert result.stderr == "BadDraftConfig: drafter config.json hidden_size is '2560', expected int\n"


def test_missing_target_is_one_line(tmp_path: Path) -> None:
    result = invoke(str(tmp_path / "nowhere"))
    assert result.exit_code == 1
    assert result.stderr.startswith("CheckpointError: target ") and result.stderr.count("\n") == 1


def test_default_target_reads_gguf_metadata() -> None:
    result = invoke("default", "--json")
    assert result.exit_code == 0, result.output
    target = json.loads(result.stdout)["target"]
    assert (target["name"], target["family"], target["layers"], target["hidden_size"], target["heads"],
            target["vocab_size"]) == ("SmolLM2-135M-Instruct", "llama", 30, 576, "9 / 3", 49152)
    assert target["weight_bytes"] > 0
