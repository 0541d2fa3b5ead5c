"""kt-kernel (KTransformers' CPU MoE kernels) as a JSON-lines worker; numpy only, no torch.

Runs in its own virtualenv (suites/baselines/ktkernel.py makes it: numpy + `pip install --no-deps
kt-kernel==0.7.2`). kt_kernel/__init__ imports torch, so the package is not imported: its CPU
detection file is loaded by path and the compiled extension chosen the way it would choose it
(or as asked). The extension itself links neither torch nor CUDA. BF16 travels as uint16 arrays.

Ops:
    info     variant?                   detected variant, loaded variant, the MoE classes it has
    setup    variant?, threads          load the extension, start its CPUInfer thread pool
    load     method, experts, topk, hidden, inter, seed, max_len
             random BF16 experts (random_experts) quantized online by the MoE class
             `method` (e.g. AMXInt8_MOE, AMXBF16_MOE, AMXInt4_MOE, MOE); returns RSS growth
    forward  tokens, seed, repeats      random input / routing (random_inputs); seconds per forward
                                        (list), a checksum, and the output itself when small
The moetune side imports random_experts / random_inputs to build bit-identical weights and inputs.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl import serve  # noqa: E402

import numpy as np  # noqa: E402

_s: dict = {}


def _kt_dir() -> str:
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("kt_kernel is not installed in this interpreter's environment")
    return list(spec.submodule_search_locations)[0]


def _detect():
    path = os.path.join(_kt_dir(), "_cpu_detect.py")
    spec = importlib.util.spec_from_file_location("kt_cpu_detect", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (round to nearest even) as uint16."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def random_experts(experts: int, hidden: int, inter: int, seed: int):
    """gate [E, I, D], up [E, I, D], down [E, D, I] as BF16 bits (uint16), std 0.02, from `seed`.

    Imported by the moetune side too, so both kernels get bit-identical weights."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in ((experts, inter, hidden), (experts, inter, hidden), (experts, hidden, inter)):
        w = np.empty(shape, dtype=np.uint16)
        for e in range(experts):  # one expert at a time: no float32 copy of the whole stack
            w[e] = _bf16(rng.standard_normal(shape[1:], dtype=np.float32) * 0.02)
        out.append(w)
    return tuple(out)


def random_inputs(experts: int, topk: int, hidden: int, tokens: int, seed: int):
    """x [T, D] (BF16 bits), expert ids [T, K] int64 (distinct per token), weights [T, K] float32."""
    rng = np.random.default_rng(seed)
    x = _bf16(rng.standard_normal((tokens, hidden), dtype=np.float32))
    ids = np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)]).astype(np.int64)
    wts = rng.random((tokens, topk), dtype=np.float32)
    return x, ids, wts


def info(variant: str | None = None) -> dict:
    det = _detect()
    detected = det.detect_cpu_features()
    variants = sorted(os.path.basename(f).split("_kt_kernel_ext_")[1].split(".")[0]
                      for f in glob.glob(os.path.join(_kt_dir(), "_kt_kernel_ext_*.so")))
    return {"detected": detected, "variants": variants}


def setup(threads: int, variant: str | None = None) -> dict:
    if not isinstance(threads, int) or threads < 1:
        raise ValueError("threads must be an integer ≥ 1")
    det = _detect()
    want = variant or det.detect_cpu_features()
    ext = det.load_extension(want)
    cfg = ext.WorkerPoolConfig()
    cfg.subpool_count = 1
    cfg.subpool_numa_map = [0]
    cfg.subpool_thread_count = [threads]
    _s.update(ext=ext, cpu=ext.CPUInfer(cfg), threads=threads)
    loaded = getattr(ext, "__cpu_variant__", want)
    classes = sorted(n for n in dir(ext.moe) if n.endswith("_MOE") or n == "MOE")
    return {"requested": want, "loaded": loaded, "int8_kernel": getattr(ext, "__int8_kernel__", "?"),
            "classes": classes}


def _need(key: str, what: str):
    if key not in _s:
        raise RuntimeError(f"call {what} first")
    return _s[key]


def load(method: str, experts: int, topk: int, hidden: int, inter: int, seed: int = 0, max_len: int = 64) -> dict:
    ext = _need("ext", "setup")
    for name, v in (("experts", experts), ("topk", topk), ("hidden", hidden), ("inter", inter), ("max_len", max_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer ≥ 1")
    if topk > experts:
        raise ValueError(f"topk {topk} > experts {experts}")
    cls = getattr(ext.moe, method, None)
    if cls is None or not callable(cls):
        raise ValueError(f"this kt-kernel build has no MoE class {method!r}")
    before = _rss()
    gate, up, down = random_experts(experts, hidden, inter, seed)
    mask = np.zeros(experts, dtype=np.bool_)
    cfg = ext.moe.MOEConfig(experts, topk, hidden, inter, mask.ctypes.data)
    cfg.layer_idx = 0
    cfg.pool = _s["cpu"].backend_
    cfg.max_len = max_len
    cfg.save = False
    cfg.load = False
    cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.ctypes.data, up.ctypes.data, down.ctypes.data
    moe = cls(cfg)
    p2l = np.arange(experts, dtype=np.int64)
    t0 = time.perf_counter()
    _s["cpu"].submit(moe.load_weights_task(p2l.ctypes.data))
    _s["cpu"].sync()
    load_s = time.perf_counter() - t0
    # The classes copy (and quantize) the weights while loading: zeroing the sources afterwards leaves
    # their output unchanged (checked for AMXInt8 / AMXBF16 / AMXInt4 on 0.7.2), so they are freed here.
    nbytes = int(gate.nbytes + up.nbytes + down.nbytes)
    del gate, up, down
    _s.update(moe=moe, cfg=cfg, mask=mask, p2l=p2l, shape=(experts, topk, hidden, inter), max_len=max_len)
    return {"method": method, "load_s": load_s, "rss_growth": _rss() - before,
            "weight_bytes_bf16": nbytes}


def forward(tokens: int, seed: int = 1, repeats: int = 5, warmup: int = 1) -> dict:
    moe = _need("moe", "load")
    experts, topk, hidden, _ = _s["shape"]
    if not isinstance(tokens, int) or not 1 <= tokens <= _s["max_len"]:
        raise ValueError(f"tokens must be an integer in 1..{_s['max_len']} (the loaded max_len)")
    x, ids, wts = random_inputs(experts, topk, hidden, tokens, seed)
    out = np.zeros((tokens, hidden), dtype=np.uint16)
    bsz = np.array([tokens], dtype=np.int32)
    cpu, times = _s["cpu"], []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        cpu.submit(moe.forward_task(bsz.ctypes.data, topk, ids.ctypes.data, wts.ctypes.data,
                                    x.ctypes.data, out.ctypes.data, False))
        cpu.sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    y = _f32(out)
    return {"seconds": times, "checksum": float(np.abs(y).sum()), "finite": bool(np.isfinite(y).all()),
            "output": y.tolist() if tokens * hidden <= 65536 else None}


if __name__ == "__main__":
    sys.exit(serve({"info": info, "setup": setup, "load": load, "forward": forward}))
