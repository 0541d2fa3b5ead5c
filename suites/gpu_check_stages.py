"""The stages of suites.gpu_check: ceilings, checks, timings, sweeps (see its docstring).

Each stage takes the `Run` (device, clock, report, default tiles, deadline, shapes) and adds rows;
every measurement goes through `run.guarded`, so a failing configuration is a row, not a crash.
Shape legend as in kernels/: T tokens, D hidden, I expert intermediate, E experts, K top-k,
B decode rows, H heads, R + P latent + rope width, S context.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.cuda import fp8_gemm, fused_moe as moe, mla_decode as mla
from kernels.cuda.tiles import FP8_GEMM, MLA, MOE_DECODE, MOE_PREFILL, Fp8GemmTiles, GemmTiles, MlaTiles
from kernels.formats import DenseWeight, Fp8BlockWeight, quantize_fp8_block
from kernels.fp8_act import fused_moe_fp8_w8a8, linear_fp8_w8a8, quantize_activation_fp8
from suites.gpu_check import Result, Run

TOL = {"bf16": 1e-2, "fp16": 1e-2, "fp8": 2e-2}


def _act(run: Run) -> tuple[torch.dtype, str]:
    """Activation dtype: bf16 on a GPU; fp16 in the interpreter (its bf16 dot is wrong)."""
    return (torch.float16, "fp16") if run.device.type != "cuda" else (torch.bfloat16, "bf16")


def _knobs(tiles, prefix: str) -> dict:
    return {prefix + k: v for k, v in dataclasses.asdict(tiles).items()}


# ---------------------------------------------------------------- 1. ceilings


def ceilings(run: Run) -> None:
    s = run.shapes
    src = torch.randint(0, 256, (s.copy_bytes,), dtype=torch.uint8, device=run.device, generator=run.gen)
    dst = torch.empty_like(src)
    r = run.guarded("copy", "ceiling", "u8", {"bytes": s.copy_bytes},
                    lambda: run.timed("copy", "ceiling", "u8", {"bytes": s.copy_bytes}, lambda: dst.copy_(src),
                                      nbytes=2 * s.copy_bytes))
    del src, dst
    if r is not None and r.status == "ok":
        run.report.ceilings["copy_gbs"] = r.extra["gbs"]
        run.report.add(Result("copy", "ceiling", "u8", r.shape, metric="copy_gbs", value=r.extra["gbs"],
                              extra={"note": "bytes read + written"}))
    n = s.matmul_n
    a, b = run.randn(n, n, dtype=_act(run)[0]), run.randn(n, n, dtype=_act(run)[0])
    r = run.guarded("matmul", "ceiling", _act(run)[1], {"n": n},
                    lambda: run.timed("matmul", "ceiling", _act(run)[1], {"n": n}, lambda: a @ b, flops=2 * n ** 3))
    if r is not None and r.status == "ok":
        run.report.ceilings["bf16_tflops"] = r.extra["tflops"]
        run.report.add(Result("matmul", "ceiling", _act(run)[1], r.shape, metric="bf16_tflops",
                              value=r.extra["tflops"], extra={"note": "torch matmul, random data"}))


# ---------------------------------------------------------------- weights shared by the stages


def moe_weights(run: Run) -> dict:
    """DeepSeek-V3-sized experts, made once: dense (activation dtype) and FP8-block (quantized from
    them, a few experts at a time to bound the float32 temporaries)."""
    if getattr(run, "_moe", None) is None:
        s, (dt, _) = run.shapes, _act(run)
        w13 = run.randn(s.moe_e, 2 * s.moe_i, s.moe_d, dtype=dt, scale=s.moe_d ** -0.5)
        w2 = run.randn(s.moe_e, s.moe_d, s.moe_i, dtype=dt, scale=s.moe_i ** -0.5)
        run._moe = {"bf16": (DenseWeight(w13), DenseWeight(w2)), "fp8": (_quantize(w13), _quantize(w2))}
    return run._moe


def _quantize(w: torch.Tensor, chunk: int = 16) -> Fp8BlockWeight:
    parts = [quantize_fp8_block(w[i:i + chunk]) for i in range(0, w.shape[0], chunk)]
    return Fp8BlockWeight(torch.cat([p.w for p in parts]), torch.cat([p.scale_inv for p in parts]))


def routing(run: Run, t: int, allowed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-K of distinct experts per token (among the first `allowed`): weights [T, K] float32, ids."""
    s = run.shapes
    pool = allowed or s.moe_e
    scores = torch.rand(t, pool, generator=run.gen, device=run.device)
    ids = scores.topk(s.moe_k, dim=-1).indices
    return torch.rand(t, s.moe_k, generator=run.gen, device=run.device), ids


def run_moe(run: Run, x, w13, w2, tw, ti, masked: bool | None = None, prefill=None, decode=None):
    t = run.tiles
    mmax = t.moe_masked_max_tokens if masked is None else (10 ** 9 if masked else 0)
    return moe.fused_moe(x, w13, w2, tw, ti, prefill=prefill or t.moe_prefill, decode=decode or t.moe_decode,
                         masked_max_tokens=mmax, quant=t.fp8_quant)


def paged_cache(run: Run, lens: list[int], block: int, width: int, holes: bool):
    """A bf16 cache with each sequence's blocks shuffled across it; -1 past each length if `holes`."""
    need = [-(-n // block) for n in lens]
    nb = sum(need) + 2
    cache = run.randn(nb, block, width, dtype=_act(run)[0])
    perm = torch.randperm(nb, generator=run.gen, device=run.device).to(torch.int32)
    tables = torch.full((len(lens), max(need) + (2 if holes else 0)), -1 if holes else 0, dtype=torch.int32,
                        device=run.device)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n
    return cache, tables, torch.tensor(lens, dtype=torch.int32, device=run.device)


# ---------------------------------------------------------------- 2. checks


def checks(run: Run) -> None:
    _check_quant(run)
    for m, n, k in run.shapes.check_gemm:
        run.guarded("fp8_gemm", "check", "fp8", {"M": m, "N": n, "K": k}, lambda: _check_gemm(run, m, n, k))
    for t in run.shapes.check_moe_tokens:
        for fmt in (_act(run)[1], "fp8"):
            for masked in (True, False):
                shape = {"T": t, "layout": "masked" if masked else "contiguous"}
                run.guarded("fused_moe", "check", fmt, shape, lambda: _check_moe(run, t, fmt, masked))
    if run.device.type == "cuda":
        run.guarded("fused_moe", "check-graph", "fp8", {"T": 8}, lambda: _check_moe_graph(run, 8))
    for h in run.shapes.mla_heads:
        lens = "/".join(map(str, run.shapes.check_mla_lens))
        run.guarded("mla_decode", "check", _act(run)[1], {"H": h, "lens": lens}, lambda: _check_mla(run, h))


def _check_quant(run: Run) -> None:
    dt, name = _act(run)
    x = run.randn(37, run.shapes.moe_d, dtype=dt, scale=30.0)
    x[1, :128] = 0
    x[2] *= 1e-4

    def check() -> Result:
        q, s = fp8_gemm.quantize_act_fp8(x, run.tiles.fp8_quant)
        rq, rs = quantize_activation_fp8(x)
        mismatched = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
        k = x.shape[1]
        r = run.check("act_quant", name, {"M": 37, "K": k}, q.float() * s.repeat_interleave(128, 1)[:, :k],
                      rq.float() * rs.repeat_interleave(128, 1)[:, :k], 1e-3)
        r.extra.update(mismatched_fp8=mismatched, scales_equal=bool(torch.equal(s, rs)))
        return r
    run.guarded("act_quant", "check", name, {"M": 37}, check)


def _check_gemm(run: Run, m: int, n: int, k: int) -> Result:
    dt, _ = _act(run)
    x = run.randn(m, k, dtype=dt)
    w = quantize_fp8_block(run.randn(n, k, dtype=torch.float32, scale=k ** -0.5))
    y = fp8_gemm.fp8_block_linear(x, w, run.tiles.fp8_gemm, run.tiles.fp8_quant)
    r = run.check("fp8_gemm", "fp8", {"M": m, "N": n, "K": k}, y, linear_fp8_w8a8(x, w), TOL["bf16"])
    r.extra["rel_err_vs_weight_only"] = _rel(y, reference.linear(x, w))
    return r


def _rel(out, ref) -> float:
    from suites.gpu_check import rel_err

    return rel_err(out, ref)


def _check_moe(run: Run, t: int, fmt: str, masked: bool) -> Result:
    dt, _ = _act(run)
    w13, w2 = moe_weights(run)["fp8" if fmt == "fp8" else "bf16"]
    tw, ti = routing(run, t, allowed=min(run.shapes.moe_e, 32) if t <= 8 else None)  # most experts empty
    x = run.randn(t, run.shapes.moe_d, dtype=dt)
    out = run_moe(run, x, w13, w2, tw, ti, masked=masked)
    ref = (fused_moe_fp8_w8a8 if fmt == "fp8" else reference.fused_moe)(x, w13, w2, tw, ti)
    r = run.check("fused_moe", fmt, {"T": t, "layout": "masked" if masked else "contiguous"}, out, ref, TOL[fmt])
    r.extra["experts_used"] = int(ti.unique().numel())
    return r


def _check_moe_graph(run: Run, t: int) -> Result:
    """Capture the masked-layout MoE (layout built inside) in a CUDA graph; replay on new inputs."""
    w13, w2 = moe_weights(run)["fp8"]
    tw, ti = routing(run, t)
    x = run.randn(t, run.shapes.moe_d)
    fn = lambda: run_moe(run, x, w13, w2, tw, ti, masked=True)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    tw2, ti2 = routing(run, t)
    tw.copy_(tw2)
    ti.copy_(ti2)
    x.copy_(run.randn(t, run.shapes.moe_d))
    graph.replay()
    torch.cuda.synchronize()
    return run.check("fused_moe", "fp8", {"T": t}, out, run_moe(run, x, w13, w2, tw, ti, masked=True), 1e-6,
                     variant="check-graph")


def _check_mla(run: Run, h: int) -> Result:
    s, (dt, name) = run.shapes, _act(run)
    lens = list(s.check_mla_lens)
    cache, tables, lens_t = paged_cache(run, lens, s.mla_block, s.mla_r + s.mla_p, holes=True)
    q_lat, q_pe = run.randn(len(lens), h, s.mla_r, dtype=dt), run.randn(len(lens), h, s.mla_p, dtype=dt)
    scale = (s.mla_r // 4 + s.mla_p) ** -0.5
    out = mla.mla_decode(q_lat, q_pe, cache, tables, lens_t, scale, tiles=run.tiles.mla)
    ref = reference.mla_decode(q_lat, q_pe, cache, tables.clamp(min=0), lens_t, scale)
    return run.check("mla_decode", name, {"H": h, "lens": "/".join(map(str, lens))}, out, ref, TOL[name])


# ---------------------------------------------------------------- 3. timings


def timings(run: Run) -> None:
    for m, n, k in run.shapes.gemm:
        _time_gemm(run, m, n, k)
    for t in run.shapes.decode_tokens:
        for fmt in (_act(run)[1], "fp8"):
            _time_moe(run, t, fmt, decode=True)
    for t in run.shapes.prefill_tokens:
        for fmt in (_act(run)[1], "fp8"):
            _time_moe(run, t, fmt, decode=False)
    for h in run.shapes.mla_heads:
        for b in run.shapes.mla_batches:
            _time_mla(run, h, b)


def _random_fp8_weight(run: Run, n: int, k: int) -> Fp8BlockWeight:
    w = run.randn(n, k, dtype=torch.float32 if run.device.type != "cuda" else torch.bfloat16, scale=64.0)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=run.gen, device=run.device) * 1e-3 + 1e-3
    return Fp8BlockWeight(w.clamp(-448, 448).to(torch.float8_e4m3fn), scale)


def _time_gemm(run: Run, m: int, n: int, k: int, tiles: Fp8GemmTiles | None = None, torch_s: float | None = None):
    """Ours (quantize + GEMM, and the GEMM alone) against torch's bf16 matmul and blockwise _scaled_mm."""
    dt, name = _act(run)
    shape, flops = {"M": m, "N": n, "K": k}, 2 * m * n * k
    x, w = run.randn(m, k, dtype=dt), _random_fp8_weight(run, n, k)
    tiles = tiles or run.tiles.fp8_gemm
    if torch_s is None:
        wb = run.randn(n, k, dtype=dt)
        tr = run.guarded("fp8_gemm", "torch-bf16", name, shape,
                         lambda: run.timed("fp8_gemm", "torch-bf16", name, shape, lambda: F.linear(x, wb), flops=flops))
        torch_s = tr.median if tr is not None and tr.status == "ok" else None
        del wb
        _time_scaled_mm(run, x, w, shape, flops, torch_s)
    q, s = fp8_gemm.quantize_act_fp8(x, run.tiles.fp8_quant)
    knobs = _knobs(tiles, FP8_GEMM)
    variant = "ours" if tiles == run.tiles.fp8_gemm else "ours-sweep"
    run.guarded("fp8_gemm", variant, "fp8", shape, lambda: run.timed(
        "fp8_gemm", variant, "fp8", shape, lambda: fp8_gemm.fp8_block_linear(x, w, tiles, run.tiles.fp8_quant),
        flops=flops, knobs=knobs, torch_s=torch_s))
    run.guarded("fp8_gemm", variant + "-gemm", "fp8", shape, lambda: run.timed(
        "fp8_gemm", variant + "-gemm", "fp8", shape, lambda: fp8_gemm.fp8_gemm(q, s, w, dt, tiles),
        flops=flops, knobs=knobs, torch_s=torch_s))
    return torch_s


def _time_scaled_mm(run: Run, x, w: Fp8BlockWeight, shape: dict, flops: int, torch_s) -> None:
    """torch's own FP8 block-scaled GEMM (cuBLAS through torch._scaled_mm), where this torch has it."""
    q, s = fp8_gemm.quantize_act_fp8(x, run.tiles.fp8_quant)
    ours = fp8_gemm.fp8_gemm(q, s, w, x.dtype, run.tiles.fp8_gemm)

    layouts = [(s.t().contiguous().t(), w.scale_inv.t()), (s, w.scale_inv.t().contiguous()),
               (s.t().contiguous().t(), w.scale_inv.t().contiguous())]  # which scale layouts cuBLAS takes varies

    def measure() -> Result:
        errors = []
        for scale_a, scale_b in layouts:
            def scaled_mm(scale_a=scale_a, scale_b=scale_b):
                return torch._scaled_mm(q, w.w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
            try:
                err = _rel(scaled_mm(), ours)
            except Exception as e:  # noqa: BLE001 - try the next layout
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
            if err > 1e-2:
                errors.append(f"disagrees with the FP8 block math (rel {err:.2e})")
                continue
            break
        else:
            raise RuntimeError("torch._scaled_mm: " + " | ".join(errors))
        r = run.timed("fp8_gemm", "torch-scaled-mm", "fp8", shape, scaled_mm, flops=flops, torch_s=torch_s)
        r.extra["note"] = "speedup_vs_torch here = torch bf16 / torch._scaled_mm"
        return r
    run.guarded("fp8_gemm", "torch-scaled-mm", "fp8", shape, measure)


def _expert_bytes(w13, w2, ids: torch.Tensor, experts: int) -> int:
    """Weight bytes a MoE call must read: every touched expert's w13 and w2 (scales included)."""
    return int(ids.unique().numel()) * (w13.nbytes + w2.nbytes) // experts


def torch_moe(x, w13, w2, tw, ti) -> torch.Tensor:
    """torch's own MoE: per touched expert, gather its tokens, two GEMMs in x.dtype (FP8 experts
    dequantized to x.dtype first), SiLU·up, weighted index_add."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    i = w2.shape[-1]
    for e in ti.unique().tolist():
        tok, slot = (ti == e).nonzero(as_tuple=True)
        a = w13[e].dequantize(x.dtype)
        gu = x[tok] @ a.T
        y = (F.silu(gu[:, :i]) * gu[:, i:]) @ w2[e].dequantize(x.dtype).T
        out.index_add_(0, tok, y.float() * tw[tok, slot, None])
    return out.to(x.dtype)


def _time_moe(run: Run, t: int, fmt: str, decode: bool, tiles: GemmTiles | None = None, torch_s=None):
    s, (dt, _) = run.shapes, _act(run)
    w13, w2 = moe_weights(run)["fp8" if fmt == "fp8" else "bf16"]
    tw, ti = routing(run, t)
    x = run.randn(t, s.moe_d, dtype=dt)
    shape = {"T": t, "layout": "masked" if decode else "contiguous"}
    nbytes, flops = _expert_bytes(w13, w2, ti, s.moe_e), 2 * t * s.moe_k * 3 * s.moe_d * s.moe_i
    if torch_s is None:
        tr = run.guarded("fused_moe", "torch-loop", fmt, shape, lambda: run.timed(
            "fused_moe", "torch-loop", fmt, shape, lambda: torch_moe(x, w13, w2, tw, ti), nbytes=nbytes, flops=flops))
        torch_s = tr.median if tr is not None and tr.status == "ok" else None
    tiles = tiles or (run.tiles.moe_decode if decode else run.tiles.moe_prefill)
    knobs = _knobs(tiles, MOE_DECODE if decode else MOE_PREFILL)
    kw = {"decode": tiles} if decode else {"prefill": tiles}
    fn = lambda: run_moe(run, x, w13, w2, tw, ti, masked=decode, **kw)  # noqa: E731
    sweep = tiles not in (run.tiles.moe_decode, run.tiles.moe_prefill)
    variant = "ours-sweep" if sweep else "ours"
    if not (sweep and decode):  # a decode sweep is timed in its graph only (eager: host-bound layout)
        run.guarded("fused_moe", variant, fmt, shape, lambda: run.timed(
            "fused_moe", variant, fmt, shape, fn, nbytes=nbytes, flops=flops, knobs=knobs, torch_s=torch_s))
    if decode and run.device.type == "cuda":
        run.guarded("fused_moe", variant + "-graph", fmt, shape, lambda: run.timed(
            "fused_moe", variant + "-graph", fmt, shape, fn, nbytes=nbytes, flops=flops, knobs=knobs,
            graph=True, torch_s=torch_s))
    return torch_s


def torch_mla(q_lat, q_pe, cache, tables, lens, scale) -> torch.Tensor:
    """torch's own MLA decode for equal lengths: gather the paged rows, two batched GEMMs in the cache
    dtype, softmax in float32."""
    b, r = q_lat.shape[0], q_lat.shape[-1]
    s = int(lens.max())
    kv = cache[tables.long()].flatten(1, 2)[:, :s]  # [B, S, R + P]
    scores = torch.einsum("bhr,bsr->bhs", q_lat, kv[..., :r]) + torch.einsum("bhp,bsp->bhs", q_pe, kv[..., r:])
    probs = (scores.float() * scale).softmax(-1).to(kv.dtype)
    return torch.einsum("bhs,bsr->bhr", probs, kv[..., :r])


def _time_mla(run: Run, h: int, b: int, tiles: MlaTiles | None = None, torch_s=None):
    s, (dt, name) = run.shapes, _act(run)
    shape = {"H": h, "B": b, "S": s.mla_context}
    cache, tables, lens = paged_cache(run, [s.mla_context] * b, s.mla_block, s.mla_r + s.mla_p, holes=False)
    q_lat, q_pe = run.randn(b, h, s.mla_r, dtype=dt), run.randn(b, h, s.mla_p, dtype=dt)
    scale = 0.1
    nbytes = b * s.mla_context * (s.mla_r + s.mla_p) * cache.element_size()
    flops = 2 * b * h * s.mla_context * (2 * s.mla_r + s.mla_p)
    if torch_s is None:
        tr = run.guarded("mla_decode", "torch-einsum", name, shape, lambda: run.timed(
            "mla_decode", "torch-einsum", name, shape, lambda: torch_mla(q_lat, q_pe, cache, tables, lens, scale),
            nbytes=nbytes, flops=flops))
        torch_s = tr.median if tr is not None and tr.status == "ok" else None
    tiles = tiles or run.tiles.mla
    variant = "ours" if tiles == run.tiles.mla else "ours-sweep"
    fn = lambda: mla.mla_decode(q_lat, q_pe, cache, tables, lens, scale, tiles=tiles)  # noqa: E731
    r = run.guarded("mla_decode", variant, name, shape, lambda: run.timed(
        "mla_decode", variant, name, shape, fn, nbytes=nbytes, flops=flops, knobs=_knobs(tiles, MLA), torch_s=torch_s))
    if r is not None and r.status == "ok":
        r.extra["splits"] = tiles.kv_splits or mla.auto_splits(b, h, tiles.head_block, _sms(run))
    return torch_s


def _sms(run: Run) -> int:
    return torch.cuda.get_device_properties(run.device).multi_processor_count if run.device.type == "cuda" else 4


# ---------------------------------------------------------------- 4. sweeps

# Tile sets that compile for sm_90 without spills (python -m suites.hopper_compile checks a set here).
GEMM_SWEEP = [Fp8GemmTiles(128, 128, 128, 8, 8, 4), Fp8GemmTiles(64, 128, 128, 8, 4, 3),
              Fp8GemmTiles(64, 256, 128, 8, 8, 3), Fp8GemmTiles(128, 64, 128, 8, 4, 4),
              Fp8GemmTiles(128, 128, 64, 8, 8, 4), Fp8GemmTiles(64, 128, 64, 8, 4, 5)]
DECODE_SWEEP = [GemmTiles(16, 32, 128, 4, 4), GemmTiles(16, 128, 128, 4, 3), GemmTiles(16, 64, 128, 4, 6),
                GemmTiles(16, 64, 64, 4, 6), GemmTiles(16, 128, 128, 8, 4), GemmTiles(32, 64, 128, 4, 4)]
PREFILL_SWEEP = [GemmTiles(64, 64, 128, 4, 3), GemmTiles(128, 64, 64, 8, 3), GemmTiles(64, 128, 64, 8, 3),
                 GemmTiles(64, 64, 128, 4, 4)]
MLA_SWEEP = [MlaTiles(16, 64, 0, 8, 3, 2), MlaTiles(16, 16, 0, 4, 3, 2), MlaTiles(16, 32, 0, 4, 3, 2),
             MlaTiles(16, 32, 0, 8, 2, 2), MlaTiles(32, 32, 0, 8, 2, 2), MlaTiles(16, 32, 4, 4, 2, 2)]

def sweeps(run: Run) -> None:
    """A few tile sets per kernel on the shapes the targets name, most wanted first, while time is left."""
    m, n, k = (4096, 7168, 7168) if (4096, 7168, 7168) in run.shapes.gemm else run.shapes.gemm[0]
    for tiles in GEMM_SWEEP:
        _time_gemm(run, m, n, k, tiles=tiles, torch_s=math.nan)
    for tiles in DECODE_SWEEP:
        _time_moe(run, 64, "fp8", decode=True, tiles=tiles, torch_s=math.nan)
    for tiles in MLA_SWEEP:
        _time_mla(run, 16, 64, tiles=tiles, torch_s=math.nan)
    for tiles in DECODE_SWEEP:
        _time_moe(run, 8, "fp8", decode=True, tiles=tiles, torch_s=math.nan)
    for tiles in PREFILL_SWEEP:
        _time_moe(run, run.shapes.prefill_tokens[0], "fp8", decode=False, tiles=tiles, torch_s=math.nan)
    for tiles in MLA_SWEEP:
        _time_mla(run, 128, 64, tiles=tiles, torch_s=math.nan)

