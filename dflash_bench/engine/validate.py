"""Checkpoint validation before load: every tensor's name, shape, dtype and byte range.

A broken checkpoint that loads is served as garbage (a header saying I16 over bf16 bytes loads as
integers); one that fails inside `mx.load` or a matmul fails with no name. Everything here is
answerable from the configs, the safetensors / GGUF headers and the file sizes (kilobytes read, no
weight), so `inspect`, `serve` and the Engine ask it before any weight is loaded and refuse with one
line naming the file and the tensor. What only the weights can tell (NaN or infinite values) is
checked as they load (checkpoint.py's `_check_and_cast`, drafters/dflash.py's `load_drafter`).
tests/test_broken_checkpoints.py holds the corpus of what is refused.

Rules, the same for target and drafter:
- byte ranges: each tensor's range lies inside the file, is exactly its shape times its dtype's
  size, and no two ranges overlap (a GGUF's also start on its alignment);
- dtypes: float tensors are F32, F16 or BF16; a packed matrix (`.weight` beside `.scales`) is U32
  with float scales and biases; a GGUF's are float or ggml block types, never integer types;
- names and shapes: every tensor the config implies is present at its shape; an unknown tensor is
  refused, not ignored (a `q_proj.bias` the config does not describe means another model), except
  those the loaders drop on purpose (vision tower, MTP head, a tied lm_head's copy);
- quantization: a packed matrix's shapes must follow from the config's bits and group size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dflash_bench.engine import gguf
from dflash_bench.engine.checkpoint import (
    canonical_hf,
    expected_shapes,
    gguf_config,
    read_target_config,
    resolve,
    weight_files,
)
from dflash_bench.engine.draft_config import QUANT_BITS, DraftConfig, read_draft_config
from dflash_bench.engine.errors import CheckpointError
from dflash_bench.engine.inventory import check_inventory, read_safetensors_header, tensors_of
from dflash_bench.engine.preload import check_pair
from dflash_bench.engine.target_config import TargetConfig

Shape = tuple[int, ...]
# safetensors dtype names and their sizes in bytes (the format's own list).
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
FLOATS = ("F32", "F16", "BF16")


def check_checkpoints(target: str | Path, drafter: str | Path | None) -> tuple[TargetConfig, DraftConfig | None]:
    """The target's and drafter's configs, pair and tensors checked (what `serve` and the Engine ask
    before loading); raises the one-line refusal. The pair is checked from the configs before any
    tensor header is read, so a drafter for another target is refused from the two configs alone."""
    path = resolve(target)
    header = gguf.read_header(path) if path.is_file() else None
    cfg = gguf_config(path, header) if header is not None else read_target_config(path)
    draft = read_draft_config(drafter) if drafter is not None else None
    if draft is not None:
        check_pair(cfg, draft)
    _check_target_tensors(path, header, cfg)
    if draft is not None:
        check_drafter(drafter, draft)
    return cfg, draft


def check_target(target: str | Path) -> TargetConfig:
    """A target's config and every tensor in its files (a GGUF's header is read once)."""
    path = resolve(target)
    header = gguf.read_header(path) if path.is_file() else None
    cfg = gguf_config(path, header) if header is not None else read_target_config(path)
    _check_target_tensors(path, header, cfg)
    return cfg


def _check_target_tensors(path: Path, header: gguf.Header | None, cfg: TargetConfig) -> None:
    if header is not None:
        _check_gguf(path, header, cfg)
    else:
        check_target_files(path, cfg)


def check_target_files(folder: Path, cfg: TargetConfig) -> None:
    """A safetensors target's files against its config: byte ranges, dtypes, names and shapes."""
    stored: dict[str, tuple[Path, dict[str, Any]]] = {}
    for f in weight_files(folder):
        for name, entry in checked_entries(f).items():
            if name in stored:
                raise CheckpointError(f"{f}: tensor {name!r} is also in {stored[name][0].name}")
            stored[name] = (f, entry)
    expected = expected_shapes(cfg)
    found: set[str] = set()
    for key, (f, entry) in stored.items():
        module, _, leaf = key.rpartition(".")
        if leaf in ("scales", "biases"):
            if f"{module}.weight" not in stored:
                raise CheckpointError(f"{f}: tensor {key!r} has no {module}.weight beside it")
            continue
        name = canonical_hf(key)
        if name is None or (name == "lm_head.weight" and name not in expected):
            continue  # dropped by the loader on purpose (checkpoint.py's _stage)
        if name not in expected:
            raise CheckpointError(f"{f}: tensor {key!r} is not part of this {cfg.family} target ({name!r} is unexpected)")
        found.add(name)
        want = expected[name]
        if f"{module}.scales" in stored:
            _check_packed(f, key, stored, want, _quant_hint(cfg, module))
            continue
        _check_dtype(f, key, entry["dtype"], FLOATS)
        shape = tuple(entry["shape"])
        hf_conv = name.endswith("conv1d.weight") and shape == (want[0], 1, want[1])  # HF's (C, 1, K)
        if shape != want and not hf_conv:
            raise CheckpointError(f"{f}: tensor {key!r} has shape {shape}, the config gives {want}")
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(f"{folder}: tensor {missing[0]!r} is missing (the config gives shape {expected[missing[0]]})")


def check_drafter(folder: str | Path, draft: DraftConfig) -> None:
    """A drafter's files against its config: byte ranges and dtypes, then the inventory (names,
    shapes, packed shapes) as inventory.py defines it."""
    folder = Path(folder)
    folder = folder if folder.is_dir() else folder.parent
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights beside config.json")
    merged: dict[str, Any] = {}
    for f in files:
        for name, entry in checked_entries(f).items():
            if name in merged:
                raise CheckpointError(f"{f}: tensor {name!r} appears in more than one file of {folder}")
            packed = name.endswith(".weight") and draft.quantization is not None and len(entry["shape"]) == 2
            _check_dtype(f, name, entry["dtype"], ("U32",) if packed else FLOATS)
            merged[name] = entry
    try:
        check_inventory(draft, merged)
    except CheckpointError as err:  # inventory.py judges headers wherever they come from: name the folder
        raise CheckpointError(f"{folder}: {err}") from None


def checked_entries(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of one safetensors file, each with a known dtype, a shape of sizes >= 0 and
    a byte range that is its exact size, inside the file and overlapping no other."""
    header = read_safetensors_header(path)
    size = path.stat().st_size
    data_bytes = size - 8 - _header_length(path)
    ranges = []
    for name, entry in tensors_of(header).items():
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: tensor {name!r} has a header entry {entry!r}, expected an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in ITEM_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r}, not a safetensors dtype")
        if not _ints(shape, 0):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r}, expected a list of sizes >= 0")
        if not _ints(offsets, 0) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, expected [start, end]")
        start, end = offsets
        nbytes = math.prod(shape) * ITEM_BYTES[dtype]
        if end - start != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {end - start} bytes, its {dtype} shape {tuple(shape)} takes {nbytes}"
            )
        if end > data_bytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {end} of the data, the file holds {max(data_bytes, 0)} (truncated?)"
            )
        ranges.append((start, end, name))
    _check_no_overlap(path, ranges)
    return tensors_of(header)


def _header_length(path: Path) -> int:
    with path.open("rb") as f:
        return int.from_bytes(f.read(8), "little")


def _ints(value: Any, minimum: int) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value
    )


def _check_no_overlap(path: Path, ranges: list[tuple[int, int, str]]) -> None:
    ranges.sort()
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
        if start < end:
            raise CheckpointError(f"{path}: tensors {first!r} and {second!r} overlap (bytes {start} to {end})")


def _check_dtype(path: Path, name: str, dtype: str, allowed: tuple[str, ...]) -> None:
    if dtype not in allowed:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, expected {' or '.join(allowed)}")


def _quant_hint(cfg: TargetConfig, module: str) -> tuple[int, int] | None:
    """(group_size, bits) the config gives a packed module: its own override, else the block's."""
    quant = cfg.raw.get("quantization") or cfg.raw.get("quantization_config")
    if not quant:
        return None
    q = quant.get(module)
    q = q if isinstance(q, dict) else quant
    return q["group_size"], q["bits"]


def _check_packed(
    path: Path, key: str, stored: dict[str, tuple[Path, dict[str, Any]]], want: Shape, hint: tuple[int, int] | None
) -> None:
    """A packed matrix: U32 words of `bits` each, float scales and biases a group (mlx-lm's affine
    layout); bits and group size from the config, else from the stored shapes as the loader reads them."""
    module = key.removesuffix(".weight")
    w = stored[key][1]
    scales = stored[f"{module}.scales"][1]
    if f"{module}.biases" not in stored:
        raise CheckpointError(f"{path}: tensor {key!r} is quantized without {module}.biases (only affine is read)")
    biases = stored[f"{module}.biases"][1]
    _check_dtype(path, key, w["dtype"], ("U32",))
    _check_dtype(path, f"{module}.scales", scales["dtype"], FLOATS)
    _check_dtype(path, f"{module}.biases", biases["dtype"], FLOATS)
    *lead, cols = want
    if hint is None:
        bits = w["shape"][-1] * 32 // cols if w["shape"] else 0
        group_size = cols // scales["shape"][-1] if scales["shape"] and scales["shape"][-1] else 0
    else:
        group_size, bits = hint
    if bits not in QUANT_BITS or not group_size or cols % group_size or cols * bits % 32:
        raise CheckpointError(
            f"{path}: tensor {key!r} of {cols} columns cannot be packed at {bits} bits in groups of {group_size}"
        )
    shapes = {
        key: (w, (*lead, cols * bits // 32)),
        f"{module}.scales": (scales, (*lead, cols // group_size)),
        f"{module}.biases": (biases, (*lead, cols // group_size)),
    }
    for name, (entry, shape) in shapes.items():
        if tuple(entry["shape"]) != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(entry['shape'])}, {bits}-bit groups of {group_size} "
                f"give {shape}"
            )


def _check_gguf(path: Path, header: gguf.Header, cfg: TargetConfig) -> None:
    """A GGUF's tensor infos: known types, byte ranges inside the data section, names and shapes."""
    alignment = header.metadata.get("general.alignment", gguf.DEFAULT_ALIGNMENT)
    expected = expected_shapes(cfg)
    found: set[str] = set()
    ranges = []
    for info in header.tensors.values():
        if info.ggml_type not in gguf.GGML_BLOCKS:
            raise CheckpointError(f"{path}: tensor {info.name!r} has ggml type {info.type_name}, not a float or quantized type")
        block, block_bytes = gguf.GGML_BLOCKS[info.ggml_type]
        count = math.prod(info.shape)
        if not info.shape or info.shape[-1] % block:
            raise CheckpointError(f"{path}: tensor {info.name!r} of shape {info.shape} is not whole {info.type_name} blocks")
        start = header.data_start + info.offset
        end = start + count // block * block_bytes
        if info.offset % alignment:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} starts at data offset {info.offset}, off the {alignment}-byte alignment"
            )
        if end > header.file_size:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} ends at byte {end}, the file holds {header.file_size} (truncated?)"
            )
        ranges.append((start, end, info.name))
        module, _, leaf = info.name.rpartition(".")
        canonical = gguf.canonical_module(module)
        name = f"{canonical}.{leaf}" if canonical else info.name
        if name not in expected:
            raise CheckpointError(f"{path}: tensor {info.name!r} is not part of this llama target")
        if info.shape != expected[name]:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} has shape {info.shape}, the metadata gives {expected[name]}"
            )
        found.add(name)
    _check_no_overlap(path, ranges)
    missing = [n for n in expected if n not in found]
    if missing:
        module, _, leaf = missing[0].rpartition(".")
        name = f"{gguf.gguf_module(module)}.{leaf}"
        raise CheckpointError(f"{path}: tensor {name!r} is missing (the metadata gives shape {expected[missing[0]]})")
