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
engine's rounds with it are not yet timed there.
"""

from __future__ import annotations

import mlx.core as mx

TemplateArg = int | bool | mx.Dtype

# The C++ type MLX's `cuda_kernel` writes for a dtype template argument (its dtype_to_cuda_type).
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"}


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
        self.source, self.header = source, header
        self.kernels: dict[tuple, object] = {}

    def kernel(self, template: tuple[tuple[str, TemplateArg], ...]):
        """The kernel object for these constants, made at its first use."""
        made = self.kernels.get(template)
        if made is None:
            made = self.kernels[template] = mx.fast.cuda_kernel(
                name=self.name + suffix(template), input_names=self.input_names, output_names=self.output_names,
                source=constants(template) + self.source, header=self.header, ensure_row_contiguous=True)
        return made

    def __call__(self, inputs: list[mx.array], template: list[tuple[str, TemplateArg]] | tuple, **launch) -> list[mx.array]:
        return self.kernel(tuple(template))(inputs=inputs, **launch)
