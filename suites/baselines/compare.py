"""`moetune compare`: our engine and its baselines on the same model, machine and run, alternately.

    moetune compare [--model small] [--baselines llama.cpp,ik_llama.cpp,ktransformers] [--workloads io:128/32,ttft:512]
                    [--precision bf16|int8|int8-head|fp32] [--repeats 5] [--threads N]

Workloads (the seeds' workloads, scaled to the machine by their lengths):
    io:P/D        one request, P prompt tokens, D generated: TTFT, TPOT, prefill and decode tokens/s
    ttft:P1,P2    prompt sweep, TTFT only (2 tokens generated)
    batch:B/P/D   B requests of P prompt tokens decoded together, D tokens each: aggregate decode
                  tokens/s and time per decode step (ours: continuous batching; llama.cpp and
                  ik_llama.cpp: the batch API, one llama_decode of B tokens per step, each request
                  its own sequence id)
    moe:T1,T2     the fused MoE layer alone (--moe-shape, --moe-experts) vs kt-kernel, T tokens

io/ttft/batch workloads run against llama.cpp and ik_llama.cpp (the same GGUF export; by default
both, ik_llama.cpp where its build is present: suites/baselines/ikllama.py --setup), moe workloads
against kt-kernel. Each workload runs ours, theirs, … in turn (one warm-up each first, then --repeats
rounds, each run after SETTLE_S of quiet so that no engine's lingering threads share the cores with the
next), the same fixed-seed prompt token ids for all (no tokenizer in the loop), greedy, EOS ignored.
Ratios pair engine by engine (baseline time / our time: > 1 means we are faster). Every setting (threads,
precision, GGUF type, build flags, versions, kernel back ends, machine fingerprint) goes with the
rows to the result store (suite "compare"); `moetune report` draws them (compare.html).
"""
from __future__ import annotations

import json
import os
import statistics
import sys

from engine.errors import MoetuneError
from results.labels import workload_label

BASELINES = ("llama.cpp", "ik_llama.cpp", "ktransformers")
GGUF_BASELINES = ("llama.cpp", "ik_llama.cpp")  # the whole model, from the GGUF export
ALIASES = {"llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "ik_llama.cpp": "ik_llama.cpp",
           "ik-llama.cpp": "ik_llama.cpp", "ikllama": "ik_llama.cpp", "ik": "ik_llama.cpp",
           "ktransformers": "ktransformers", "kt-kernel": "ktransformers", "kt": "ktransformers"}
PRECISIONS = {"bf16": ("bfloat16", "bf16"), "fp32": ("float32", "f32"), "int8": ("bfloat16", "q8_0"),
              "int8-head": ("bfloat16", "q8_0")}
DEFAULT_WORKLOADS = "io:128/32,ttft:512"


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="our engine vs llama.cpp / ik_llama.cpp / kt-kernel, same model and machine, "
                                       "alternating runs")
    c.add_argument("--model", default="small", help="preset or checkpoint directory (default small)")
    c.add_argument("--baselines", default=None,
                   help=f"comma list of {', '.join(BASELINES)} (or ik); default: llama.cpp, and ik_llama.cpp "
                        "where its build is present")
    c.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                   help="comma list: io:P/D, ttft:P[;P...], moe:T[;T...] (default %(default)s)")
    c.add_argument("--precision", default="bf16", choices=sorted(PRECISIONS),
                   help="ours ↔ GGUF: bf16 ↔ BF16, fp32 ↔ F32, int8 (INT8-channel) ↔ Q8_0, both LM heads BF16 as "
                        "released INT8 checkpoints keep it; int8-head: the LM head INT8 too (`moetune quantize "
                        "--lm-head`) ↔ Q8_0 with a Q8_0 output matrix, as llama.cpp quantizes by default")
    c.add_argument("--repeats", type=int, default=5, help="measured runs per engine (≥ 5 for the record)")
    c.add_argument("--threads", type=int, default=None, help="threads for every engine (default: usable cores)")
    c.add_argument("--moe-shape", default="v3", help="moe workloads: v3 (7168/2048/top-8), small, tiny")
    c.add_argument("--moe-experts", type=int, default=64, help="moe workloads: experts in the layer (V3 has 256)")
    c.add_argument("--profile", default=None,
                   help="io / ttft / batch workloads: our engine with a tuned profile, 'auto' (this machine's profile for "
                        "the model) or a TOML; default: the knobs' defaults, untuned")
    c.add_argument("--json", action="store_true", help="the rows as JSON lines instead of the table")
    c.set_defaults(func=run_compare)


def parse_workloads(text: str) -> list[dict]:
    """'io:128/32,ttft:512;2048,moe:1;4' → [{kind, prompt, decode} | {kind, tokens}] (';' or ',' inside)."""
    out: list[dict] = []
    kind = None
    for part in [p.strip() for p in text.replace(";", ",").split(",") if p.strip()]:
        if ":" in part:
            kind, part = part.split(":", 1)
        if kind not in ("io", "ttft", "moe", "batch"):
            raise MoetuneError(f"workload {part!r}: kind must be io, ttft, batch or moe (e.g. io:128/32)")
        try:
            if kind == "batch":
                b, p, d = part.split("/")
                w = {"kind": "batch", "batch": int(b), "prompt": int(p), "decode": int(d)}
            elif kind == "io":
                p, d = part.split("/")
                w = {"kind": "io", "prompt": int(p), "decode": int(d)}
            elif kind == "ttft":
                w = {"kind": "ttft", "prompt": int(part), "decode": 2}
            else:
                w = {"kind": "moe", "tokens": int(part)}
        except ValueError:
            raise MoetuneError(f"workload {kind}:{part} is not well formed (io:P/D, ttft:P, batch:B/P/D, moe:T)") from None
        if min(v for k, v in w.items() if k != "kind") < 1 or (kind != "moe" and w["decode"] < 2):
            raise MoetuneError(f"workload {kind}:{part}: lengths must be ≥ 1 (decode ≥ 2)")
        out.append(w)
    if not out:
        raise MoetuneError("no workloads given")
    return out


def parse_baselines(text: str | None) -> list[str]:
    """The --baselines list, canonical names; None: llama.cpp, and ik_llama.cpp if it is built."""
    if text is None:
        from suites.baselines.ikllama import have_ik_llama

        return ["llama.cpp"] + (["ik_llama.cpp"] if have_ik_llama() else [])
    names = [b.strip().lower() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in ALIASES]
    if bad or not names:
        raise MoetuneError(f"unknown baseline {bad[0] if bad else text!r} (choose from {', '.join(BASELINES)})")
    return list(dict.fromkeys(ALIASES[b] for b in names))


def py_loop(engine: str) -> str:
    """The row name of an engine's runs timed by our clock around its Python binding's per-token loop."""
    return f"{engine} (through Python)"


def our_model(model: str, precision: str) -> str:
    """The checkpoint ours runs: the model itself, or its INT8-channel quantization (cached; int8-head: with the
    LM head quantized too, which the GGUF export then writes as Q8_0)."""
    if precision not in ("int8", "int8-head"):
        return model
    from engine.weights.presets import resolve_model
    from engine.weights.quantize import cached_quantization

    return str(cached_quantization(resolve_model(model), "int8", lm_head=precision == "int8-head"))


# ------------------------------------------------------------------ measuring

# Seconds of quiet before each engine's timed run. Engines in other processes keep their threads busy for a
# while after a call returns: kt-kernel's worker spins long enough that our V3 MoE layer at T=1, timed right
# after its forward, took 32 ms instead of 15 (2 threads; kt-kernel's own time did not change with the
# pause). The pause is the same before every engine, ours included.
SETTLE_S = 0.1


def settle() -> None:
    import time

    time.sleep(SETTLE_S)


def alternate(engines: dict, prompt: list[int], decode: int, repeats: int) -> dict[str, list[dict]]:
    """engine name → its runs; one warm-up each, then ours, theirs, … `repeats` times, each run after
    SETTLE_S of quiet."""
    from tqdm import tqdm

    for run in engines.values():
        run(prompt, 2)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in tqdm(range(repeats), desc=f"D={decode}", leave=False):
        for name, run in engines.items():
            settle()
            runs[name].append(run(prompt, decode))
    return runs


def io_metrics(runs: list[dict], prompt: int) -> dict[str, tuple[list[float], str, str]]:
    """metric → (samples, unit, direction)."""
    return {"ttft_s": ([r["ttft_s"] for r in runs], "s", "minimize"),
            "tpot_s": ([r["decode_s"] / r["decoded"] for r in runs if r["decoded"]], "s", "minimize"),
            "prefill_tok_s": ([prompt / r["ttft_s"] for r in runs], "tok/s", "maximize"),
            "decode_tok_s": ([r["decoded"] / r["decode_s"] for r in runs if r["decoded"]], "tok/s", "maximize")}


def rows_for(engine: str, metrics: dict, workload: dict, model: str, fmt: str, settings: dict) -> list[dict]:
    return [{"model": model, "format": fmt, "workload": workload, "metric": m, "unit": unit, "direction": d,
             "samples": samples, "extra": {"engine": engine, "settings": settings}}
            for m, (samples, unit, d) in metrics.items() if samples]


def gguf_kinds(baselines: list[str]) -> list[type]:
    """The driver classes of the GGUF baselines asked for; a missing build is one error here, before
    any export or model load."""
    from suites.baselines.ikllama import IkLlamaCpp, require_ik_llama
    from suites.baselines.llamacpp import LlamaCpp, require_llama_cpp

    kinds = {"llama.cpp": (require_llama_cpp, LlamaCpp), "ik_llama.cpp": (require_ik_llama, IkLlamaCpp)}
    wanted = [kinds[b] for b in GGUF_BASELINES if b in baselines]
    for require, _ in wanted:
        require()
    return [cls for _, cls in wanted]


def load_all(kinds: list[type], gguf, threads: int, n_ctx: int) -> list:
    """Each driver with the GGUF loaded in its worker (those already started are closed if one fails)."""
    loaded = []
    try:
        for cls in kinds:
            loaded.append(cls(gguf, threads, n_ctx=n_ctx))
    except BaseException:
        for e in loaded:
            e.close()
        raise
    return loaded


def run_lm(args, workloads: list[dict], threads: int, baselines: list[str]) -> list[dict]:
    """io / ttft / batch workloads: ours vs llama.cpp and ik_llama.cpp on the whole model."""
    import torch

    from engine.llm import LLM
    from suites.baselines.llamacpp import ensure_gguf
    from suites.e2e import run_batch, run_once

    kinds = gguf_kinds(baselines)
    if not kinds:
        return []
    dtype, gtype = PRECISIONS[args.precision]
    longest = max(w["prompt"] + w["decode"] for w in workloads)
    if any(w["kind"] == "batch" and w["batch"] * w["prompt"] > 512 for w in workloads):
        raise MoetuneError("batch workloads: B × P must be ≤ 512 (every engine prefills the B prompts in one step)")
    gguf = ensure_gguf(our_model(args.model, args.precision), gtype)
    if args.baselines is None:  # the default set: ik_llama.cpp where it can run the model, else a note
        from suites.baselines.ikllama import IkLlamaCpp, ik_refusal

        why = IkLlamaCpp in kinds and ik_refusal(gguf)
        if why:
            print(f"note: {why}; comparing without it", file=sys.stderr)
            kinds.remove(IkLlamaCpp)
    llm = LLM(our_model(args.model, args.precision), dtype=dtype, knobs={"threads": threads},
              profile=args.profile)
    if args.profile and llm.profile is None:
        raise MoetuneError(f"--profile {args.profile}: no tuned profile for {llm.model_key} on this machine "
                           "(run moetune autotune first, or leave --profile out for the defaults)")
    ours_settings = {"engine": "moetune", "threads": threads, "dtype": dtype, "precision": args.precision,
                     "profile": str(llm.profile.path) if llm.profile else None,
                     "backend": llm.knobs["kernel_backend"], "torch": torch.__version__,
                     "weight_bytes": sum(getattr(w, "nbytes", 0) for w in llm.model.w.values())}
    rows = []
    engines_loaded = load_all(kinds, gguf, threads, max(4096, longest + 64))
    try:
        settings = {"moetune": ours_settings}
        for e in engines_loaded:
            settings[e.engine] = settings[py_loop(e.engine)] = {**e.settings, "gguf_type": gtype}
        for w in workloads:
            g = torch.Generator().manual_seed(w["prompt"])
            if w["kind"] == "batch":  # B different prompts, decoded together by each engine
                prompt = [torch.randint(2, llm.config.vocab_size, (w["prompt"],), generator=g).tolist()
                          for _ in range(w["batch"])]
                engines = {"moetune": lambda p, d: run_batch(llm, p, d)} | {e.engine: e.run_batch for e in engines_loaded}
            else:
                prompt = torch.randint(2, llm.config.vocab_size, (w["prompt"],), generator=g).tolist()
                engines = {"moetune": lambda p, d: run_once(llm, p, d)} | {e.engine: e.run_once for e in engines_loaded}
            runs = alternate(engines, prompt, w["decode"], args.repeats)
            # each GGUF engine by its own clock (llama_perf_context / llama_get_timings); the same runs by
            # our clock around its Python binding's per-token loop are kept as a row of their own
            for e in engines_loaded:
                runs[py_loop(e.engine)] = [{**r, **r["python"]} for r in runs[e.engine]]
            for engine, engine_runs in runs.items():
                m = io_metrics(engine_runs, w["prompt"] * w.get("batch", 1))
                if w["kind"] == "ttft":
                    m = {k: v for k, v in m.items() if k in ("ttft_s", "prefill_tok_s")}
                if w["kind"] == "batch":  # per decode step (B tokens), not per token
                    m["tpot_s"] = ([r["decode_s"] / (r["decoded"] / w["batch"]) for r in engine_runs], "s",
                                   "minimize")
                rows += rows_for(engine, m, w, args.model, args.precision, settings[engine])
    finally:
        for e in engines_loaded:
            e.close()
    return rows


def run_moe(args, workloads: list[dict], threads: int) -> list[dict]:
    """moe workloads: our fused MoE vs kt-kernel's on the same layer, weights and inputs."""
    import kernels
    from engine.knobs import resolve_knobs
    import numpy as np
    import torch

    from suites.baselines.ktkernel import METHODS, SHAPES, KtKernel, our_inputs, our_layer, relative_error, time_ours

    fmt = "bf16" if args.precision in ("bf16", "fp32") else "int8" if args.precision == "int8-head" else args.precision
    if args.moe_shape not in SHAPES:
        raise MoetuneError(f"--moe-shape must be one of {', '.join(SHAPES)}")
    if fmt not in METHODS:
        raise MoetuneError(f"kt-kernel has no {fmt} MoE class")
    shape, E = SHAPES[args.moe_shape], args.moe_experts
    torch.set_num_threads(threads)
    backend_name = resolve_knobs({})["kernel_backend"]
    backend = kernels.get_backend(backend_name)
    w13, w2 = our_layer(fmt, E, shape, seed=0, backend=backend)
    model = f"moe-{args.moe_shape}-{E}e"
    rows = []
    with KtKernel(threads) as kt:
        load = kt.load(fmt, E, shape, seed=0, max_len=max(w["tokens"] for w in workloads))
        kt_settings = {"engine": "kt-kernel", "threads": threads, "version": "0.7.2", **kt.setup,
                       "method": load["method"], "rss_growth": load["rss_growth"]}
        kt_settings.pop("classes", None)
        ours_settings = {"engine": "moetune", "threads": threads, "backend": backend_name, "format": fmt,
                         "weight_bytes": int(w13.nbytes + w2.nbytes)}
        for w in workloads:
            T = w["tokens"]
            x, wts, ids = our_inputs(E, shape, T, seed=T)
            time_ours(backend, w13, w2, x, wts, ids, 0)  # warm-up
            kt.forward(T, seed=T, repeats=1)
            ours, theirs, err = [], [], None
            for _ in range(args.repeats):
                settle()
                t, y = time_ours(backend, w13, w2, x, wts, ids, 1, warmup=0)
                ours += t
                settle()
                r = kt.forward(T, seed=T, repeats=1, warmup=0)
                theirs += r["seconds"]
                if r["output"] is not None:
                    err = relative_error(y, np.asarray(r["output"]))
            for engine, samples, settings in (("moetune", ours, ours_settings), ("kt-kernel", theirs, kt_settings)):
                rows += rows_for(engine, {"moe_s": (samples, "s", "minimize")}, w, model, fmt,
                                 {**settings, "rel_err_vs_other": err})
    return rows


# ------------------------------------------------------------------ output


def _spread(samples: list[float], scale: float) -> str:
    s = sorted(samples)
    return f"{statistics.median(s) * scale:.4g} [{s[0] * scale:.3g}–{s[-1] * scale:.3g}]"


def table(rows: list[dict]) -> str:
    """llama-bench compare style: one line per workload × metric; ours, then one column per baseline
    (median [min–max] and its ratio to ours)."""
    by: dict[tuple, dict[str, list[float]]] = {}
    units = {}
    for r in rows:
        key = (json.dumps(r["workload"], sort_keys=True), r["metric"])
        by.setdefault(key, {})[r["extra"]["engine"]] = r["samples"]
        units[r["metric"]] = (r["unit"], r["direction"])
    names = list(dict.fromkeys(n for engines in by.values() for n in engines if n != "moetune"))
    lines = ["| workload | metric | moetune: median [min–max] | "
             + " | ".join(f"{n}: median [min–max] (ratio)" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for (wl, metric), engines in by.items():
        unit, direction = units[metric]
        scale, shown = (1e3, "ms") if unit == "s" else (1.0, unit)
        ours = engines.get("moetune")
        if not ours:
            continue
        cells = []
        for name in names:
            theirs = engines.get(name)
            if not theirs:
                cells.append("–")
                continue
            a, b = statistics.median(ours), statistics.median(theirs)
            cells.append(f"{_spread(theirs, scale)} ({b / a if direction == 'minimize' else a / b:.2f}×)")
        lines.append(f"| {workload_label(wl)} | {metric} ({shown}) | {_spread(ours, scale)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_compare(args) -> int:
    from results.store import append_rows, new_run_id
    from engine.fingerprint import fingerprint

    if args.repeats < 1:
        raise MoetuneError("--repeats must be ≥ 1 (≥ 5 for published figures)")
    baselines = parse_baselines(args.baselines)
    workloads = parse_workloads(args.workloads)
    threads = args.threads or len(os.sched_getaffinity(0))
    lm = [w for w in workloads if w["kind"] != "moe"]
    moe = [w for w in workloads if w["kind"] == "moe"]
    rows = []
    if lm and any(b in GGUF_BASELINES for b in baselines):
        rows += run_lm(args, lm, threads, baselines)
    if moe and "ktransformers" in baselines:
        rows += run_moe(args, moe, threads)
    if not rows:
        raise MoetuneError("nothing to compare: io/ttft/batch workloads need llama.cpp or ik_llama.cpp, "
                           "moe workloads need ktransformers")
    fp = fingerprint()
    for r in rows:
        r["extra"]["machine"] = {k: fp.get(k) for k in ("cpu_model", "hash", "hardware_key")}
    run_id = new_run_id()
    append_rows(rows, "compare", run_id=run_id)
    if args.json:
        for r in rows:
            print(json.dumps(r, default=str))
        return 0
    models = ", ".join(dict.fromkeys(r["model"] for r in rows))
    print(f"moetune compare — {models} ({args.precision}), {threads} threads, {args.repeats} alternating "
          f"repeats, on {fp.get('cpu_model')} [{fp.get('hash')}], run {run_id}")
    tuned = next((r["extra"]["settings"].get("profile") for r in rows
                  if r["extra"]["engine"] == "moetune" and r["extra"]["settings"].get("profile")), None)
    print(f"moetune: tuned profile {tuned}" if tuned else "moetune: the knobs' defaults (untuned)")
    print(table(rows))
    print("ratio: baseline time / ours (or ours / baseline for rates): > 1 means moetune is faster", file=sys.stderr)
    return 0
