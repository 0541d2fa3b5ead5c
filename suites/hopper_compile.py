"""Compile the Triton kernels for Hopper (sm_90) on any machine, no GPU needed, and read the result.

    python -m suites.hopper_compile [--arch 90] [--json]

Each kernel is compiled exactly as its wrapper would launch it: the wrapper (kernels/cuda) runs on
small host tensors of DeepSeek-V3's real widths with the kernel replaced by a recorder, and the
recorded launch (argument types, constexprs, warps, stages) goes to Triton's ahead-of-time compiler
with the specialization the JIT gives on a GPU (16-byte-aligned pointers; integers divisible by 16
marked so, except the kernel's do_not_specialize ones). Reported per launch: registers, stack
bytes (spills), shared memory, and the instruction mix read from the SASS with the cuobjdump that
ships in Triton's wheel: QGMMA/HGMMA (Hopper wgmma), HMMA (mma.sync), LDGSTS (cp.async), LDL/STL
(local memory). This is what costs no device time: compile errors, spills and the tensor-core path
show here before a GPU is lent. Triton's version here may differ from the GPU machine's.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

_TYPES = {torch.float8_e4m3fn: "fp8e4nv", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}
_INSTR = ("QGMMA", "HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDL", "STL")


@dataclass
class Launch:
    name: str  # which launch of which wrapper, e.g. "fused_moe/gate_up"
    fn: object  # the JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records instead of launching."""

    def __init__(self, fn, name: str, out: list):
        self.fn, self.name, self.out = fn, name, out

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.out.append(Launch(self.name, self.fn, args, kwargs))
        return record


def _signature(launch: Launch) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of a recorded launch, as the GPU JIT would specialize."""
    fn = launch.fn
    names = fn.arg_names
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages") if k in launch.kwargs}
    values = dict(zip(names, launch.args)) | {k: v for k, v in launch.kwargs.items() if k not in options}
    const_names = {p.name for p in fn.params if p.is_constexpr}
    keep = set(getattr(fn, "do_not_specialize", ()))
    keep |= {names[i] for i in keep if isinstance(i, int)}
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(names):
        v = values[n]
        if n in const_names:
            sig[n], consts[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[n], attrs[(i,)] = "*" + _TYPES[v.dtype], [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[n] = "i1"
        elif isinstance(v, int):
            sig[n] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
            if v % 16 == 0 and n not in keep:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32"
    return sig, consts, attrs, options


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_launch(launch: Launch, arch: int = 90) -> dict:
    """Compile one recorded launch for sm_<arch>; its resources and instruction counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs, options = _signature(launch)
    kernel = triton.compile(ASTSource(launch.fn, sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    counts = collections.Counter(re.findall(r"\b(" + "|".join(_INSTR) + r")\b", sass))
    return {"launch": launch.name, "regs": regs, "stack": stack, "shared": kernel.metadata.shared,
            **{k: counts.get(k, 0) for k in _INSTR}, **options}


# ---------------------------------------------------------------- recording the wrappers

_MODULES = {"kernels.cuda.fp8_gemm": "_act_quant_kernel", "kernels.cuda.fused_moe": "_moe_gemm_kernel",
            "kernels.cuda.mla_decode": "_mla_split_kernel"}  # module → one of its kernels


def _jit_modules() -> list:
    """The kernel modules with compiled (not interpreted) kernels: those loaded, or fresh copies
    imported without TRITON_INTERPRET (sys.modules is left as it was)."""
    import triton

    loaded = [sys.modules.get(n) for n in _MODULES]
    if all(m is not None and isinstance(getattr(m, k), triton.runtime.JITFunction)
           for m, k in zip(loaded, _MODULES.values())):
        return loaded
    saved = {n: sys.modules.pop(n, None) for n in _MODULES}
    env = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return [importlib.import_module(n) for n in _MODULES]
    finally:
        if env is not None:
            os.environ["TRITON_INTERPRET"] = env
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def record(tiles, dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """Every kernel launch of the cuda backend at `tiles` (kernels.cuda.tiles.CudaTiles), DeepSeek-V3
    widths (D 7168, I 2048, two experts; MLA R 512 + P 64, 16 heads), activations in `dtype`."""
    from kernels.formats import DenseWeight, Fp8BlockWeight

    fp8_gemm, fused_moe, mla_decode = _jit_modules()

    launches: list[Launch] = []
    saved = {(m, a): getattr(m, a) for m, a in ((fp8_gemm, "_act_quant_kernel"), (fp8_gemm, "_fp8_gemm_kernel"),
                                                (fused_moe, "_moe_gemm_kernel"), (mla_decode, "_mla_split_kernel"),
                                                (mla_decode, "_mla_merge_kernel"))}
    try:
        for (m, a), fn in saved.items():
            setattr(m, a, _Recorder(fn, a.strip("_"), launches))
        d, i, e = 7168, 2048, 2
        x = torch.zeros(64, d, dtype=dtype)
        w = Fp8BlockWeight(torch.zeros(1536, d, dtype=torch.float8_e4m3fn), torch.ones(12, 56))
        fp8_gemm.fp8_block_linear(x, w, tiles.fp8_gemm, tiles.fp8_quant)
        ids = torch.tensor([[0, 1]] * 4)
        fp8_w = (Fp8BlockWeight(torch.zeros(e, 2 * i, d, dtype=torch.float8_e4m3fn), torch.ones(e, 32, 56)),
                 Fp8BlockWeight(torch.zeros(e, d, i, dtype=torch.float8_e4m3fn), torch.ones(e, 56, 16)))
        dense_w = (DenseWeight(torch.zeros(e, 2 * i, d, dtype=dtype)), DenseWeight(torch.zeros(e, d, i, dtype=dtype)))
        for fmt, (w13, w2) in (("fp8", fp8_w), ("dense", dense_w)):
            for masked in (True, False):
                n = len(launches)
                fused_moe.fused_moe(x[:4], w13, w2, torch.ones(4, 2), ids, prefill=tiles.moe_prefill,
                                    decode=tiles.moe_decode, masked_max_tokens=10 ** 6 if masked else 0,
                                    quant=tiles.fp8_quant)
                for launch in launches[n:]:
                    if launch.name == "moe_gemm_kernel":
                        part = "gate_up" if launch.kwargs["GATE_UP"] else "down"
                        launch.name = f"moe_{fmt}_{'masked' if masked else 'contiguous'}_{part}"
        cache = torch.zeros(8, 64, 576, dtype=dtype)
        mla_decode.mla_decode(torch.zeros(2, 16, 512, dtype=dtype), torch.zeros(2, 16, 64, dtype=dtype), cache,
                              torch.zeros(2, 4, dtype=torch.int32), torch.tensor([100, 200], dtype=torch.int32),
                              0.1, tiles=tiles.mla)
    finally:
        for (m, a), fn in saved.items():
            setattr(m, a, fn)
    unique = {}
    for launch in launches:  # quantizer launches repeat: keep one per name
        unique.setdefault(launch.name, launch)
    return list(unique.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.hopper_compile", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true", help="one JSON list of the reports instead of a table")
    args = ap.parse_args(argv)
    from engine.knobs import CATALOGUE
    from kernels.cuda.tiles import CudaTiles

    tiles = CudaTiles.from_knobs({n: k.default for n, k in CATALOGUE.items() if k.component == "kernels/cuda"})
    cols = ("launch", "regs", "stack", "shared", *_INSTR, "num_warps", "num_stages")
    reports = []
    if not args.json:
        print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
    for launch in record(tiles):
        reports.append(compile_launch(launch, args.arch))
        if not args.json:
            print("| " + " | ".join(str(reports[-1].get(c, "")) for c in cols) + " |", flush=True)
    if args.json:
        print(json.dumps(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
