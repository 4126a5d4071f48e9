"""Our CUDA kernels as MLX calls, one compiled kernel object per set of constants.

`mx.fast.cuda_kernel` takes a kernel's constants as template arguments, and on every call turns them into
C++ (the kernel's name, then one `constexpr` or `using` line each, written with `fmt`) before it writes
the whole source out again; a decode forward of the 9B makes about 160 such calls (129 of the row
kernel), and their Python is the host's share of a round (docs/gpu-round-profile.md). `BakedKernel` takes
the same call but writes each distinct set of constants into a source once, as the very lines MLX would
write, and keeps one kernel object for it that is then called without template arguments: the kernel
that runs is the same code, so its bits are the same. On the H200 (tools/kernel_call_probe.py,
docs/profiles/kernel-call-probe-h200.txt, a run beside other work) building a row-kernel call cost
1.5-4.9 us less that way at four shapes, with the bits equal to the templated call's at each; the
engine's rounds with it are not yet timed there. A variant's first launch in a process also keeps its compiled
code where MLX looks for it (engine/kernel_cache.py), so the next process on the machine does not compile it.
Each source is handed over compacted (cuda_source.compact: no comments or indentation), since MLX hashes the
whole of it at every evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx

from dflash_bench.engine import kernel_cache
from dflash_bench.engine.backend import on_cuda
from dflash_bench.engine.cuda_source import compact
from dflash_bench.engine.kernel_cache import CUDA_TYPES  # MLX's C++ type a dtype template argument becomes

TemplateArg = int | bool | mx.Dtype


def constants(template: tuple[tuple[str, TemplateArg], ...]) -> str:
    """The lines `mx.fast.cuda_kernel` puts at the top of a kernel body for these template arguments."""
    if not template:
        return ""
    lines = []
    for name, value in template:
        if isinstance(value, mx.Dtype):
            lines.append(f"  using {name} = {CUDA_TYPES[value]};\n")
        elif isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        else:
            lines.append(f"  constexpr int {name} = {value};\n")
    return "".join(lines) + "\n"


def suffix(template: tuple[tuple[str, TemplateArg], ...]) -> str:
    """The kernel name's tail for these constants (`_4096_24576_4_64...`, as a profile lists a templated one)."""
    return "".join(f"_{str(v).rsplit('.', 1)[-1]}" if isinstance(v, mx.Dtype) else f"_{str(v).lower()}"
                   if isinstance(v, bool) else f"_{v}" for _, v in template)


class BakedKernel:
    """Stands where `mx.fast.cuda_kernel(...)`'s object stood, with the same call (inputs, template, grid,
    threadgroup, output shapes and dtypes): the first call with a set of constants makes a kernel object
    whose source starts with them (`constants`); later calls with them call it without template arguments."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], source: str, header: str):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.source, self.header = compact(source), compact(header)  # the bytes MLX hashes at every evaluation
        self.kernels: dict[tuple, object] = {}

    def kernel(self, template: tuple[tuple[str, TemplateArg], ...]):
        """The kernel object for these constants, made at its first use."""
        made = self.kernels.get(template)
        if made is None:
            made = self.kernels[template] = mx.fast.cuda_kernel(
                name=self.name + suffix(template), input_names=self.input_names, output_names=self.output_names,
                source=constants(template) + self.source, header=self.header, ensure_row_contiguous=True)
        return made

    def variant(self, template: tuple[tuple[str, TemplateArg], ...], input_dtypes: list[mx.Dtype],
                output_dtypes: list[mx.Dtype]) -> tuple[str, str, str, list, list]:
        """These constants' variant as `kernel` makes it, in kernel_cache.mlx_source's arguments: its name, header,
        body (the constants, then the source), and its (name, dtype) inputs and outputs."""
        return (self.name + suffix(template), self.header, constants(template) + self.source,
                list(zip(self.input_names, input_dtypes)), list(zip(self.output_names, output_dtypes)))

    def __call__(self, inputs: list[mx.array], template: list[tuple[str, TemplateArg]] | tuple, **launch) -> list[mx.array]:
        template = tuple(template)
        made = self.kernels.get(template)
        if made is None:
            made = self.made(template, lambda: ([x.dtype for x in inputs], launch["output_dtypes"]))
        return made(inputs=inputs, **launch)

    def bound(self, template: tuple[tuple[str, TemplateArg], ...], input_dtypes: list[mx.Dtype],
              output_dtypes: list[mx.Dtype]):
        """The kernel object for these constants, to call without them (`__call__` looks it up at every call; a
        caller that launches one variant many times keeps it)."""
        made = self.kernels.get(template)
        return made if made is not None else self.made(template, lambda: (input_dtypes, output_dtypes))

    def made(self, template: tuple[tuple[str, TemplateArg], ...], dtypes: Callable[[], tuple[list, list]]):
        """A variant's kernel object at its first use in the process: on CUDA, a worker keeps its code for the next
        process (`dtypes`: its inputs' and outputs', asked for only then)."""
        made = self.kernel(template)
        cache = kernel_cache.active() if on_cuda() else None
        if cache is not None:
            cache.keep(*self.variant(template, *dtypes()))
        return made


def bind(kernel, template: tuple[tuple[str, TemplateArg], ...], input_dtypes: list[mx.Dtype],
         output_dtypes: list[mx.Dtype]) -> Callable[..., list[mx.array]]:
    """A launch object's call with these constants: a BakedKernel's kernel object for them (`bound`); a stand-in
    (tests/cuda_emulator.py's, tools/forward_ops.py's templated launches) takes them at each call."""
    if isinstance(kernel, BakedKernel):
        return kernel.bound(template, input_dtypes, output_dtypes)
    return partial(kernel, template=template)
