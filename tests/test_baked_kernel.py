"""Our kernels' launch objects with their constants written into the source (engine/baked_kernel.py).

Everywhere: the lines written are the ones MLX's `cuda_kernel` writes for template arguments, and a set of
constants makes one kernel object, called after that without template arguments. Where g++ is: the row,
recurrence and attention kernels launched that way run, through tests/cuda_emulator.py, to the same bits
as the same sources launched with template arguments, and constants written wrong (a different K) do not.
Everywhere: each source is handed to MLX compacted (engine/cuda_source.py's `compact`), every C++ token kept.
"""

from __future__ import annotations

import re

import cuda_emulator
import pytest
from test_attention_kernel import inputs
from test_delta_kernel import HEADS, window

import mlx.core as mx

from dflash_bench.engine import baked_kernel, matmul_kernel, matmul_source
from dflash_bench.engine.baked_kernel import BakedKernel, constants
from dflash_bench.engine.cuda_source import compact
from dflash_bench.engine.targets import attention_kernel, attention_source, delta_kernel, norm_rope_kernel


@pytest.fixture
def fresh_launches():
    """No cached launch object outlives the test, nor reaches into it (each may hold an emulator)."""
    caches = (matmul_kernel._kernel, delta_kernel._kernel, attention_kernel._partial_kernel, attention_kernel._combine_kernel)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def test_constants_are_the_lines_mlx_writes_for_template_arguments() -> None:
    """MLX's `cuda_kernel` (mlx/backend/cuda/custom_kernel.cpp's build_kernel) writes `constexpr int`,
    `constexpr bool` and `using` lines, two spaces in, then a blank line, before the body."""
    template = (("K", 4096), ("CAUSAL", True), ("T", mx.bfloat16), ("YT", mx.float32), ("W", 0))
    assert constants(template) == ("  constexpr int K = 4096;\n  constexpr bool CAUSAL = true;\n"
                                   "  using T = __nv_bfloat16;\n  using YT = float;\n  constexpr int W = 0;\n\n")
    assert constants(()) == ""
    assert baked_kernel.suffix(template) == "_4096_true_bfloat16_float32_0"


def test_each_set_of_constants_makes_one_kernel_called_without_template_arguments(monkeypatch) -> None:
    made, calls = [], []

    def cuda_kernel(**spec):
        made.append(spec)
        return lambda index=len(made) - 1, **launch: calls.append((index, launch)) or ["y"]

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    kernel = BakedKernel("k", ["x"], ["y"], "  y[0] = x[0] * N;  // scaled\n", "// header\n#define TWO 2\n")
    for n in (3, 5, 3, 3):  # a new list each call, as attention_kernel.py builds its templates
        assert kernel(inputs=["x"], template=[("N", n)], grid=(1, 1, 1)) == ["y"]
    # the constants as MLX writes them, then the source compacted (cuda_source.compact)
    assert [spec["source"] for spec in made] == [f"  constexpr int N = {n};\n\ny[0] = x[0] * N;\n" for n in (3, 5)]
    assert [spec["name"] for spec in made] == ["k_3", "k_5"]
    assert all(spec["header"] == "#define TWO 2\n" and spec["ensure_row_contiguous"] for spec in made)
    assert [i for i, _ in calls] == [0, 1, 0, 0]
    assert all(launch == {"inputs": ["x"], "grid": (1, 1, 1)} for _, launch in calls)  # no template argument


@cuda_emulator.needs_gxx
def test_the_row_kernel_baked_gives_the_templated_bits_and_wrong_constants_do_not(monkeypatch, fresh_launches) -> None:
    """A 4-bit weight at 1 and 17 rows (two row tiles): the engine's launch object, its constants in the
    source, equals the source launched with template arguments bit for bit; the same source baked with the
    input width halved (`K`) gives other outputs, so the comparison can fail."""
    k, n, group = 256, 32, 64
    w = (mx.random.normal((n, k), key=mx.random.key(1)) * 0.05).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=group, bits=4)
    s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
    x = mx.random.normal((17, k), key=mx.random.key(2)).astype(mx.bfloat16)
    with monkeypatch.context() as patch:
        cuda_emulator.install_matmul(patch)
        templated = [matmul_kernel.rows_matmul(x[:m], q, s, b, 4, group) for m in (1, 17)]
    cuda_emulator.install_cuda_kernel(monkeypatch)
    assert isinstance(matmul_kernel._kernel(), BakedKernel)
    baked = [matmul_kernel.rows_matmul(x[:m], q, s, b, 4, group) for m in (1, 17)]
    for want, got in zip(templated, baked):
        assert mx.all(mx.isfinite(got)).item() and mx.array_equal(want, got).item()
    call = matmul_kernel.launch(17, k, n, 4, group, ())
    wrong = tuple((name, value // 2 if name == "K" else value) for name, value in call.options["template"])
    kernel = matmul_kernel._kernel().kernel(wrong)
    options = {o: v for o, v in call.options.items() if o != "template"}
    (off,) = kernel(inputs=[x, q, s, b, call.rows, x, x], **options)  # x: the unread residual and norm
    assert not mx.array_equal(off, baked[1]).item()


@cuda_emulator.needs_gxx
def test_the_recurrence_kernel_baked_gives_the_templated_bits(monkeypatch, fresh_launches) -> None:
    """Windows of 1 and 3 rows in one launch of delta_kernel.py (int and dtype constants): rows and states
    equal, bit for bit, to the same source launched with template arguments."""
    windows = [window(HEADS["small"], rows, seed=90 + rows) for rows in (1, 3)]
    with monkeypatch.context() as patch:
        cuda_emulator.install_delta(patch)
        templated = delta_kernel.delta_windows(windows)
    cuda_emulator.install_cuda_kernel(monkeypatch)
    assert isinstance(delta_kernel._kernel(1, len(windows), False), BakedKernel)
    for (y_want, s_want), (y, s) in zip(templated, delta_kernel.delta_windows(windows)):
        assert mx.array_equal(y_want, y).item() and mx.array_equal(s_want, s).item()


@cuda_emulator.needs_gxx
def test_the_attention_kernels_baked_give_the_templated_bits(monkeypatch, fresh_launches) -> None:
    """Both passes of attention_kernel.py (a dtype, ints, the causal flag) over segments of 4 and 1 rows, one
    across a partition: equal, bit for bit, to the same sources launched with template arguments."""
    segments = inputs((4, 2, 64), [4, 1], [attention_kernel.PARTITION - 2, 9], mx.bfloat16, seed=5)
    with monkeypatch.context() as patch:
        cuda_emulator.install(patch)
        templated = attention_kernel.decode_attention(segments, 64**-0.5)
    cuda_emulator.install_cuda_kernel(monkeypatch)
    assert isinstance(attention_kernel._partial_kernel(2), BakedKernel)
    got = attention_kernel.decode_attention(segments, 64**-0.5)
    assert mx.all(mx.isfinite(got)).item() and mx.array_equal(templated, got).item()


# -- the sources handed to MLX: compacted (cuda_source.compact) --------------------------------------
def engine_sources() -> dict[str, str]:
    """Every header and body the engine's launch objects are made from, as their modules write them."""
    sources = {"matmul header": matmul_source.HEADER, "matmul rope header": matmul_source.ROPE_HEADER,
               "matmul rope": matmul_source.source(0, rope=True), "attention header": attention_source.HEADER,
               "attention combine": attention_source.COMBINE, "delta header": delta_kernel._HEADER,
               "norm-rope header": norm_rope_kernel._HEADER, "norm-rope keys": norm_rope_kernel._KEYS}
    sources |= {f"matmul {parts} parts": matmul_source.source(parts) for parts in range(4)}
    sources |= {f"attention {s} {block} {joint}": attention_source.partial_source(s, block, joint)
                for s in (1, 3) for block in (False, True) for joint in (False, True)}
    sources |= {f"attention {s} {block} layered": attention_source.partial_source(s, block, True, True)
                for s in (1, 3) for block in (False, True)}
    sources |= {f"delta {tail}": delta_kernel.source(2, 3, tail) for tail in (False, True)}
    sources |= {f"norm-rope {norm}": norm_rope_kernel.qk_source(norm) for norm in (False, True)}
    return sources


TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[A-Za-z_0-9.]+|\S')


def test_compacting_keeps_every_token_of_each_engine_source_and_drops_its_comments() -> None:
    """Each source's C++ tokens (its `//` comments cut: none of its literals holds one) are the compacted
    source's, in order, so the compiled code is the same; the compacted source holds no comment and no
    indentation, keeps each preprocessor line whole, and is a third or more smaller across the row kernel's."""
    total = small = 0
    for name, text in engine_sources().items():
        assert not any("//" in t or "/*" in t for t in TOKEN.findall(text) if t[0] in "\"'"), name
        got = compact(text)
        assert TOKEN.findall(got) == TOKEN.findall(re.sub(r"//[^\n]*", "", text)), name
        assert "//" not in got and not any(line != line.strip() or not line for line in got.splitlines()), name
        assert [line for line in got.splitlines() if line.startswith("#")] == [
            " ".join(line.split()) for line in text.splitlines() if line.strip().startswith("#")], name
        assert compact(got) == got
        if name.startswith("matmul"):
            total, small = total + len(text), small + len(got)
    assert small < 0.7 * total, (small, total)


def test_compacting_keeps_literals_and_lines_as_they_are() -> None:
    """String and character literals (inline PTX) keep their bytes, comment markers and runs of spaces in them
    included; a comment between tokens leaves them apart; lines never join."""
    text = ('  asm("mma  // {%0}, /* x */" : "=r"(a));  // the product\n'
            "#pragma unroll\n\n   for (int i = 0;/* */i < 4; ++i) c = '\\'';\n/* a\n block */ x = 1;\n")
    assert compact(text) == ('asm("mma  // {%0}, /* x */" : "=r"(a));\n#pragma unroll\n'
                             "for (int i = 0; i < 4; ++i) c = '\\'';\nx = 1;\n")


def test_the_engines_launch_objects_hold_their_sources_compacted() -> None:
    """What MLX is handed (and what engine/kernel_cache.py compiles and names) is the compacted source."""
    kernel = matmul_kernel._kernel(0)
    assert kernel.source == compact(matmul_source.source(0)) and kernel.header == compact(matmul_source.HEADER)
    combine = attention_kernel._combine_kernel()
    assert combine.source == compact(attention_source.COMBINE)
