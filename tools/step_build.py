"""How long Python takes to build a dense target's one-row decode step in the gpu mode, on any machine.

usage: python3 tools/step_build.py [TARGET] [--streams N] [--steps 60] [--profile]

TARGET is any llama or qwen3 target the engine loads (default: `default`, the default model). Its weights are kept
packed in bf16 as the gpu mode keeps them, every projection and attention layer is put on our kernels as the
self-check puts them on a CUDA GPU (tools/forward_ops.py runs the self-check itself on reference arithmetic, which
takes minutes on a CPU for the default model), and `mx.fast.cuda_kernel` is a stand-in whose every output is one
node depending on all the launch's inputs: so the engine's own launch objects (engine/baked_kernel.py), the
attention launch's preparation (targets/attention_kernel.py) and all of our Python around them run as on a GPU,
while what MLX's kernel object itself costs there (about 3.3 us a call on session 53's H100,
docs/gpu-round-profile.md) is replaced by the stand-in's own cost (about 0.6 ms a default-model step on this
project's CPU, in every figure). `mx.fast.rms_norm` is one node, as on a GPU. After a 32-row prompt a stream, the
median build of `--steps` steps (the first 10 left out) is printed; `--profile` adds cProfile's own times over 20
more. Run it at two revisions (PYTHONPATH=a checkout) to compare, interleaved: a shared host's speed moves.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine import tiles
from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.targets import attention_kernel, build_target, dense
from dflash_bench.engine.targets.base import Segment


class OneNodeKernel:
    """`mx.fast.cuda_kernel`'s object: each output one node depending on every input."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, inputs, grid, threadgroup, output_shapes, output_dtypes, template=None, init_value=None,
                 verbose=False) -> list[mx.array]:
        return [mx.depends([mx.zeros(shape, dtype=dtype)], inputs)[0] for shape, dtype in zip(output_shapes, output_dtypes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", default="default")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.steps <= 10:
        parser.error(f"--steps must be more than the 10 left out, not {args.steps}")
    dense.kernel_runs_here = lambda heads, device, cuda: attention_kernel.fits(*heads)
    tiles.available = lambda dtype: dtype == mx.bfloat16  # the row kernel's condition, as on a CUDA GPU
    loaded = load_target(args.target, mx.bfloat16, packed=True)
    target = build_target(loaded.config, loaded.weights, mx.bfloat16)
    if not isinstance(target, dense.DenseTarget):
        parser.error(f"{args.target} is a {loaded.config.family} target: this times a llama or qwen3 one")
    heads = (target.config.num_heads, target.config.num_kv_heads, target.config.head_dim)
    if not attention_kernel.fits(*heads):
        parser.error(f"{args.target}'s attention heads {heads[0]}/{heads[1]} of {heads[2]}: no attention launch covers "
                     f"them (targets/attention_kernel.py's `fits`), so its gpu mode would not run our kernels")
    for w in target.projections():
        w.kernel = w.fits_kernel(mx.bfloat16)
    for attn in target.attn:
        attn.path = "kernel"
    mx.fast.cuda_kernel = OneNodeKernel
    mx.fast.rms_norm = lambda x, w, eps: mx.abs(x) if w is None else x * w
    states = [target.new_state() for _ in range(args.streams)]
    for state in states:
        mx.eval(target.forward([Segment(list(range(10, 42)), 0, state, [31], prefill=True)])[0].logits, state.arrays())
        state.keep(32)

    def step(profile: cProfile.Profile | None = None) -> float:
        if profile is not None:
            profile.enable()
        began = time.perf_counter()
        outs = target.forward([Segment([5], state.length, state, [0]) for state in states])
        took = time.perf_counter() - began
        if profile is not None:
            profile.disable()
        mx.eval([o.logits for o in outs], [state.arrays() for state in states])
        for state in states:  # the same length every step: the same shapes
            state.keep(state.length - 1)
        return took

    times = [step() for _ in range(args.steps)]
    straight = getattr(target, "turned", lambda: False)()  # (revisions before DenseTarget.layers have no `turned`)
    print(f"{args.target}: {args.streams} stream(s), every projection on the row kernel: "
          f"{all(w.kernel for w in target.projections())}, layers run straight: {straight}; "
          f"one-row step built in {1e3 * statistics.median(times[10:]):.3f} ms (median of {args.steps - 10})",
          flush=True)
    if args.profile:
        profile = cProfile.Profile()
        for _ in range(20):
            step(profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
