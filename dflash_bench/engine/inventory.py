"""The tensors a drafter checkpoint must hold, checked against its safetensors header alone.

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming every
tensor's dtype, shape and byte range. Reading just that (kilobytes) tells whether a checkpoint
matches its config.json before any weight is read.

v1 (DFlash): `fc`, `hidden_norm`, `norm` and 11 tensors a layer (3 + 11 x layers). DFlash2 adds the
candidate selector (a hidden projection and two vocab x rank codebooks, bare tensors without
`.weight`) and a grouped dynamic conv around each sublayer (6 + 15 x layers). Neither holds an
embedding or an lm_head: the drafter borrows the target's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from dflash_bench.engine.constants import MIB
from dflash_bench.engine.draft_config import DraftConfig
from dflash_bench.engine.errors import CheckpointError

Shape = tuple[int, ...]
MAX_HEADER_BYTES = 100 * MIB


def _layer(draft: DraftConfig, i: int) -> dict[str, Shape]:
    h, inter = draft.hidden_size, draft.intermediate_size
    q, kv = draft.num_heads * draft.head_dim, draft.num_kv_heads * draft.head_dim
    p = f"layers.{i}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "self_attn.q_norm.weight": (draft.head_dim,),
        p + "self_attn.k_norm.weight": (draft.head_dim,),
    }


def _conv(draft: DraftConfig, prefix: str) -> dict[str, Shape]:
    """One grouped dynamic conv: a base kernel plus a projection giving per-group kernel offsets.

    The published header pins base_kernel at [2, 2, hidden] and the projection at
    2 x kernel x groups rows; with the stock kernel of 2 it does not tell which leading axis is the
    kernel, so the planner and the model read these shapes, never re-derive them.
    """
    h, k = draft.hidden_size, draft.conv_kernel_size or 0
    groups = h // draft.conv_group_size if draft.conv_group_size else 0
    return {
        prefix + ".base_kernel": (2, k, h),
        prefix + ".kernel_projection.weight": (2 * k * groups, h),
    }


def expected_inventory(draft: DraftConfig) -> dict[str, Shape]:
    """Every tensor name the drafter's checkpoint holds, with its shape, in a stable order."""
    h = draft.hidden_size
    names: dict[str, Shape] = {}
    if draft.is_dflash2:
        rank = draft.selector_rank or 0
        names["candidate_selector.hidden_projection.weight"] = (rank, h)
        names["candidate_selector.predecessor_codebook"] = (draft.vocab_size, rank)
        names["candidate_selector.successor_codebook"] = (draft.vocab_size, rank)
    names["fc.weight"] = (h, len(draft.taps) * h)
    names["hidden_norm.weight"] = (h,)
    names["norm.weight"] = (h,)
    for i in range(draft.num_layers):
        names.update(_layer(draft, i))
        if draft.is_dflash2:
            names.update(_conv(draft, f"layers.{i}.attention_conv"))
            names.update(_conv(draft, f"layers.{i}.mlp_conv"))
    return names


def stored_inventory(draft: DraftConfig) -> dict[str, Shape]:
    """What the safetensors files hold: `expected_inventory`, with each matrix (a 2-D `.weight`) of
    a quantized drafter as mlx-lm stores it: uint32 words of packed bits plus a scale and a bias a group."""
    if draft.quantization is None:
        return expected_inventory(draft)
    group_size, bits = draft.quantization
    stored: dict[str, Shape] = {}
    for name, shape in expected_inventory(draft).items():
        if len(shape) != 2 or not name.endswith(".weight"):
            stored[name] = shape
            continue
        out, cols = shape
        if cols % group_size or cols * bits % 32:
            raise CheckpointError(
                f"{draft.kind} drafter tensor {name!r} has {cols} columns, which {bits}-bit groups of {group_size} do not divide"
            )
        module = name.removesuffix(".weight")
        stored[name] = (out, cols * bits // 32)
        stored[f"{module}.scales"] = stored[f"{module}.biases"] = (out, cols // group_size)
    return stored


def tensors_of(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors header (drops `__metadata__`)."""
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def check_inventory(draft: DraftConfig, header: dict[str, Any]) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor."""
    found = tensors_of(header)
    expected = stored_inventory(draft)
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"{draft.kind} drafter checkpoint has no tensor {name!r} (expected shape {list(shape)})")
        got = tuple(found[name].get("shape", ()))
        if got != shape:
            raise CheckpointError(f"{draft.kind} drafter tensor {name!r} has shape {list(got)}, the config gives {list(shape)}")
    extra = [name for name in found if name not in expected]
    if extra:
        raise CheckpointError(f"{draft.kind} drafter checkpoint holds an unexpected tensor {extra[0]!r}")


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file; reads 8 + header-length bytes, no weights."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise CheckpointError(f"{path} is {len(prefix)} bytes long, too short for a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{path} claims a {length}-byte header in a {size}-byte file")
            raw = f.read(length)
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err.strerror or err}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} has a safetensors header that is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a safetensors header that is not a JSON object")
    return header


def weight_files(folder: str | Path) -> list[Path]:
    """The .safetensors files of a checkpoint folder, sorted (one file or shards)."""
    return sorted(Path(folder).glob("*.safetensors"))


def read_folder_header(folder: str | Path) -> dict[str, Any]:
    """The tensor entries of every .safetensors file in a folder, merged; headers only."""
    merged: dict[str, Any] = {}
    for path in weight_files(folder):
        for name, entry in tensors_of(read_safetensors_header(path)).items():
            if name in merged:
                raise CheckpointError(f"tensor {name!r} appears in more than one file of {folder}")
            merged[name] = entry
    return merged


def tensor_bytes(header: dict[str, Any]) -> int:
    """Bytes of tensor data a header describes (the sum of its byte ranges)."""
    return sum(end - start for start, end in (e["data_offsets"] for e in tensors_of(header).values()))
