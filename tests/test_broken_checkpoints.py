"""A corpus of broken checkpoints, made here from the fixture writers: `inspect` and `serve` each
refuse every one with exit 1 and one line on stderr naming the file's field or tensor.

Most are refused from configs and headers before any weight is read (engine/validate.py); NaN and
infinite weights only as the weights load (checkpoint.all_finite), where serve's loader thread
ends the server with the same one line. The good fixtures still inspect and serve.
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_bench.cli import app
from dflash_bench.engine import gguf
from dflash_bench.fixtures import small as fixtures

REPO = Path(__file__).resolve().parent.parent
BASES = ("llama", "qwen3_5", "qwen3_5-4bit", "llama-gguf", "dflash")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """One good fixture of each kind the corpus breaks (the drafter is for the llama fixture)."""
    root = tmp_path_factory.mktemp("good")
    return {kind: fixtures.write_fixture(kind, root / kind) for kind in BASES}


# --- how a checkpoint is broken ------------------------------------------------------------------


def config(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Edit config.json as a dict."""

    def apply(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))

    return apply


def setting(*keys: str, value: Any = None, delete: bool = False) -> Callable[[Path], None]:
    """Set (or delete) one config.json value by its path of keys."""

    def edit(cfg: dict[str, Any]) -> None:
        for key in keys[:-1]:
            cfg = cfg[key]
        if delete:
            del cfg[keys[-1]]
        else:
            cfg[keys[-1]] = value

    return config(edit)


def read_st(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(path: Path, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def header(edit: Callable[[dict[str, Any], bytes], None]) -> Callable[[Path], None]:
    """Edit model.safetensors' JSON header (the data bytes stay as they are)."""

    def apply(folder: Path) -> None:
        h, data = read_st(folder / "model.safetensors")
        edit(h, data)
        write_st(folder / "model.safetensors", h, data)

    return apply


def tensors(edit: Callable[[dict[str, mx.array]], None]) -> Callable[[Path], None]:
    """Rewrite model.safetensors with its tensors edited."""

    def apply(folder: Path) -> None:
        path = folder / "model.safetensors"
        weights = dict(mx.load(str(path)))
        edit(weights)
        mx.save_safetensors(str(path), weights, metadata={"format": "pt"})

    return apply


def poison(name: str, value: float) -> Callable[[dict[str, mx.array]], None]:
    def edit(w: dict[str, mx.array]) -> None:
        w[name] = mx.where(mx.arange(w[name].size).reshape(w[name].shape) == 1, value, w[name]).astype(w[name].dtype)

    return edit


def truncate(nbytes: int) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        path = path if path.is_file() else path / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-nbytes])

    return apply


def dtype_of(name: str, dtype: str) -> Callable[[Path], None]:
    return header(lambda h, data: h[name].update(dtype=dtype))


def past_the_end(name: str) -> Callable[[Path], None]:
    def edit(h: dict[str, Any], data: bytes) -> None:
        start, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [len(data), len(data) + end - start]

    return header(edit)


def overlapping(first: str, second: str) -> Callable[[Path], None]:
    return header(lambda h, data: h[second].update(data_offsets=h[first]["data_offsets"]))


def raw_header(prefix: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    """Replace the file's length prefix and header bytes (the first 8 + n bytes)."""

    def apply(folder: Path) -> None:
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        path.write_bytes(prefix(raw[: 8 + n]) + raw[8 + n :])

    return apply


def regguf(edit_weights: Callable[[dict[str, mx.array]], None] = lambda w: None,
           meta: dict[str, Any] | None = None) -> Callable[[Path], None]:
    """Write the llama GGUF fixture again with its canonical weights or metadata edited."""

    def apply(path: Path) -> None:
        d = fixtures.TARGET_DIMS["llama"]
        weights = {
            name.removeprefix("model."): w.astype(mx.float32 if w.ndim == 1 else mx.float16)
            for name, w in fixtures.target_weights("llama").items()
        }
        edit_weights(weights)
        gguf.write_llama_gguf(path, weights, fixtures.gguf_metadata() | (meta or {}),
                              num_heads=d.heads, num_kv_heads=d.kv_heads)

    return apply


def drop(name: str) -> Callable[[dict[str, mx.array]], None]:
    return lambda w: w.pop(name)


def put(name: str, value: mx.array) -> Callable[[dict[str, mx.array]], None]:
    return lambda w: w.update({name: value})


AT_LOAD = "holds NaN"  # the refusals found as weights load, not from headers
UP = "model.layers.0.mlp.up_proj.weight"
NORM0, NORM1 = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
QUANT_SCALES = "language_model.model.layers.0.mlp.up_proj.scales"

# (id, base fixture, how it is broken, what the one line must name)
CASES: list[tuple[str, str, Callable[[Path], None], str]] = [
    # target config.json values
    ("tie-as-string", "llama", setting("tie_word_embeddings", value="false"), "tie_word_embeddings is 'false'"),
    ("eps-as-word", "llama", setting("rms_norm_eps", value="tiny"), "rms_norm_eps is 'tiny'"),
    ("hidden-as-string", "llama", setting("hidden_size", value="64"), "hidden_size is '64'"),
    ("zero-layers", "llama", setting("num_hidden_layers", value=0), "num_hidden_layers is 0"),
    ("negative-ffn", "llama", setting("intermediate_size", value=-128), "intermediate_size is -128"),
    ("no-vocab-size", "llama", setting("vocab_size", delete=True), "has no vocab_size"),
    ("rope-theta-nan", "llama", setting("rope_theta", value=float("nan")), "rope_theta is nan"),
    ("context-as-float", "llama", setting("max_position_embeddings", value=4096.5), "max_position_embeddings"),
    ("eos-as-string", "llama", setting("eos_token_id", value="2"), "eos_token_id is '2'"),
    ("kv-heads-as-bool", "llama", setting("num_key_value_heads", value=True), "num_key_value_heads is True"),
    ("text-tie-as-string", "qwen3_5", setting("text_config", "tie_word_embeddings", value="true"),
     "text_config.tie_word_embeddings"),
    ("unknown-layer-kind", "qwen3_5", setting("text_config", "layer_types", 0, value="mamba"), "layer_types holds ['mamba']"),
    ("no-conv-kernel", "qwen3_5", setting("text_config", "linear_conv_kernel_dim", delete=True),
     "text_config.linear_conv_kernel_dim"),
    ("rotary-as-string", "qwen3_5", setting("text_config", "rope_parameters", "partial_rotary_factor", value="0.25"),
     "partial_rotary_factor is '0.25'"),
    ("quant-bits-9", "qwen3_5-4bit", setting("quantization", "bits", value=9), "quantization.bits is 9"),
    ("quant-block-string", "qwen3_5-4bit", setting("quantization", value="4bit"), "quantization is '4bit'"),
    ("quant-group-vs-scales", "qwen3_5-4bit", config(lambda c: c["quantization"].update(group_size=64)), "groups of 64"),
    # target tensors
    ("missing-tensor", "llama", tensors(drop("model.norm.weight")), "'norm.weight' is missing"),
    ("unknown-tensor", "llama", tensors(put("model.layers.0.self_attn.q_proj.bias", mx.zeros((64,)))), "q_proj.bias"),
    ("wrong-shape", "llama", tensors(put(UP, mx.zeros((64, 64), dtype=mx.bfloat16))), f"'{UP}' has shape (64, 64)"),
    ("vocab-mismatch", "llama", setting("vocab_size", value=600), "has shape (512, 64), the config gives (600, 64)"),
    ("i16-over-bf16", "llama", dtype_of(UP, "I16"), f"'{UP}' has dtype I16"),
    ("f32-over-bf16", "llama", dtype_of(UP, "F32"), f"'{UP}' spans"),
    ("truncated", "llama", truncate(100), "truncated"),
    ("offsets-past-end", "llama", past_the_end("model.norm.weight"), "'model.norm.weight' ends at byte"),
    ("overlapping-ranges", "llama", overlapping(NORM0, NORM1), "overlap"),
    ("header-longer-than-file", "llama", raw_header(lambda h: struct.pack("<Q", 10**12) + h[8:]), "-byte header"),
    ("header-not-json", "llama", raw_header(lambda h: h[:8] + b"x" * (len(h) - 8)), "header that is not JSON"),
    ("quant-scales-shape", "qwen3_5-4bit", tensors(lambda w: w.update({QUANT_SCALES: w[QUANT_SCALES][:, :1]})),
     "up_proj.scales' has shape"),
    ("nan-weight", "llama", tensors(poison(UP, float("nan"))), "'layers.0.mlp.up_proj.weight' holds NaN"),
    ("inf-weight", "llama", tensors(poison("model.norm.weight", float("inf"))), "'norm.weight' holds NaN or infinite"),
    ("nan-quant-scale", "qwen3_5-4bit", tensors(poison(QUANT_SCALES, float("nan"))), "up_proj.weight' holds NaN"),
    # GGUF
    ("gguf-truncated", "llama-gguf", truncate(1000), "truncated"),
    ("gguf-missing-tensor", "llama-gguf", regguf(drop("layers.0.mlp.up_proj.weight")), "'blk.0.ffn_up.weight' is missing"),
    ("gguf-wrong-shape", "llama-gguf", regguf(put("layers.0.mlp.up_proj.weight", mx.zeros((64, 64), dtype=mx.float16))),
     "'blk.0.ffn_up.weight' has shape (64, 64)"),
    ("gguf-nan-weight", "llama-gguf", regguf(put("norm.weight", mx.full((64,), float("nan")))), "'norm.weight' holds NaN"),
    ("gguf-width-as-string", "llama-gguf", regguf(meta={"llama.embedding_length": "64"}), "llama.embedding_length is '64'"),
    # drafter
    ("draft-tie-as-string", "dflash", setting("tie_word_embeddings", value="false"), "tie_word_embeddings is 'false'"),
    ("draft-eps-nan", "dflash", setting("rms_norm_eps", value=float("nan")), "rms_norm_eps is nan"),
    ("draft-block-as-string", "dflash", setting("dflash_config", "block_size", value="16"), "block_size is '16'"),
    ("draft-taps-as-strings", "dflash", setting("dflash_config", "target_layer_ids", value=["1"]), "target_layer_ids"),
    ("draft-quant-bits-9", "dflash", setting("quantization", value={"group_size": 32, "bits": 9}), "quantization.bits is 9"),
    ("draft-missing-tensor", "dflash", tensors(drop("norm.weight")), "no tensor 'norm.weight'"),
    ("draft-wrong-shape", "dflash", tensors(put("fc.weight", mx.zeros((64, 64), dtype=mx.bfloat16))), "'fc.weight' has shape"),
    ("draft-unknown-tensor", "dflash", tensors(put("lm_head.weight", mx.zeros((512, 64), dtype=mx.bfloat16))),
     "unexpected tensor 'lm_head.weight'"),
    ("draft-i16-over-bf16", "dflash", dtype_of("fc.weight", "I16"), "'fc.weight' has dtype I16"),
    ("draft-truncated", "dflash", truncate(64), "truncated"),
    ("draft-overlapping-ranges", "dflash", overlapping("layers.0.input_layernorm.weight", "norm.weight"), "overlap"),
    ("draft-nan-weight", "dflash", tensors(poison("fc.weight", float("nan"))), "'fc.weight' holds NaN"),
    ("draft-inf-weight", "dflash", tensors(poison("layers.1.mlp.down_proj.weight", float("-inf"))),
     "'layers.1.mlp.down_proj.weight' holds NaN or infinite"),
]


def broken(good: dict[str, Path], tmp_path: Path, base: str, brk: Callable[[Path], None]) -> list[str]:
    """Copy the good fixture, break it, return the command's arguments (target [--drafter D])."""
    src = good[base]
    if src.is_file():
        dst = tmp_path / src.name
        shutil.copy(src, dst)
    else:
        dst = tmp_path / base
        shutil.copytree(src, dst)
    brk(dst)
    return [str(good["llama"]), "--drafter", str(dst)] if base == "dflash" else [str(dst)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(args: list[str]) -> list[str]:
    return ["serve", *args, "--parallel", "1", "--context", "256", "--port", str(free_port())]


def assert_one_line(result, named: str) -> str:
    """Exit 1 through the CLI's own refusal (not an escaped exception), one stderr line naming it."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    line = result.stderr
    assert line.count("\n") == 1 and "Traceback" not in line, line
    assert named in line, line
    return line


def test_the_corpus_is_at_least_30_checkpoints() -> None:
    assert len(CASES) >= 30 and len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_broken_checkpoint_is_refused_by_inspect_and_serve_in_one_line(good, tmp_path: Path, case) -> None:
    _, base, brk, named = case
    args = broken(good, tmp_path, base, brk)
    runner = CliRunner()
    inspected = runner.invoke(app, ["inspect", *args])
    if AT_LOAD in named:  # only the weights tell: inspect reads none, and shows the checkpoint
        assert inspected.exit_code == 0, inspected.output
    else:
        assert_one_line(inspected, named)
        assert inspected.stdout == ""
    served = runner.invoke(app, serve_args(args))
    line = assert_one_line(served, named)
    assert line.split(":")[0] in ("CheckpointError", "BadTargetConfig", "BadDraftConfig"), line


def test_good_fixtures_still_inspect(good) -> None:
    runner = CliRunner()
    for kind in ("llama", "qwen3_5", "qwen3_5-4bit", "llama-gguf"):
        result = runner.invoke(app, ["inspect", str(good[kind]), "--json"])
        assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["inspect", str(good["llama"]), "--drafter", str(good["dflash"]), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["drafter"]["tensors"] == 3 + 11 * fixtures.DRAFT_DIMS.layers


@pytest.mark.parametrize("kind", ["llama", "qwen3_5-4bit", "llama-gguf"])
def test_good_fixtures_still_load(good, kind) -> None:
    from dflash_bench.engine.engine import Engine, Settings

    drafter = good["dflash"] if kind == "llama" else None
    engine = Engine(good[kind], drafter, Settings(context=256))
    assert engine.model_name and (engine.drafter is not None) == (drafter is not None)


def run_serve(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m dflash_bench serve ...` in a process of its own, this worktree's package first."""
    return subprocess.run(
        [sys.executable, "-m", "dflash_bench", *serve_args(args)],
        cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("name", ["i16-over-bf16", "nan-weight"])
def test_serve_process_exits_quickly_with_exactly_the_one_line(good, tmp_path: Path, name) -> None:
    """The honest check: a real `serve` process, refused before (i16) or while (nan) loading."""
    _, base, brk, named = next(c for c in CASES if c[0] == name)
    started = time.monotonic()
    proc = run_serve(broken(good, tmp_path, base, brk))
    assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and named in proc.stderr, proc.stderr
    assert time.monotonic() - started < 120
