"""HTTP load suite (bench_serving-like) against a live `moetune serve` on loopback.

    python -m suites.serving --launch small --input-len 64 --output-len 16 --num-prompts 16 --concurrency 1 4 16
    python -m suites.serving --url http://127.0.0.1:8000 --request-rate 2 --num-prompts 32

Fixed-seed random prompts (token ids) of --input-len tokens, each generating exactly --output-len
tokens (EOS ignored), streamed; arrivals at a fixed concurrency (workers back to back) or Poisson
at --request-rate requests/s (optionally capped by --concurrency). Per run: TTFT, TPOT (time per
output token after the first), ITL (gap between streamed tokens) as mean / median / p99, and
request, output-token and total-token throughput. One row per figure goes to the result store
(results.store.append_rows, suite "serving") unless --no-store.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np

LOOPBACK = ("127.0.0.1", "localhost", "::1")
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Result:
    """One request as the client saw it (perf_counter seconds)."""

    ok: bool
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))


def loopback_target(url: str) -> tuple[str, int]:
    u = urlparse(url)
    if u.scheme != "http" or u.hostname not in LOOPBACK:
        raise SystemExit(f"the load suite only targets a server on loopback (http://127.0.0.1:PORT), not {url}")
    return u.hostname, u.port or 80


def get_json(host: str, port: int, path: str) -> dict:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(input_len)] for _ in range(n)]


def send(host: str, port: int, model: str, prompt: list[int], output_len: int) -> Result:
    """One streamed completion; a chunk's arrival time per generated token."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False, start=time.perf_counter())
    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return res
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                res.chunk_times.append(time.perf_counter())
            if chunk.get("usage"):
                res.output_tokens = chunk["usage"]["completion_tokens"]
        res.ok = bool(res.chunk_times) and res.output_tokens > 0
    except OSError as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


def run_load(host: str, port: int, model: str, prompts: list[list[int]], output_len: int,
             concurrency: int, rate: float, seed: int) -> tuple[list[Result], float]:
    """Send every prompt; at most `concurrency` in flight; Poisson arrivals if rate > 0. Returns the
    results and the wall time from the first send to the last answer."""
    gaps = random.Random(seed + 1)
    slots = threading.BoundedSemaphore(concurrency)

    def one(prompt):
        try:
            return send(host, port, model, prompt, output_len)
        finally:
            slots.release()

    t0 = time.perf_counter()
    futures = []
    with ThreadPoolExecutor(concurrency) as pool:
        for prompt in prompts:
            if rate > 0:
                time.sleep(gaps.expovariate(rate))
            slots.acquire()
            futures.append(pool.submit(one, prompt))
        results = [f.result() for f in futures]
    return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float, input_len: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def stats(xs: list[float]) -> dict:
        if not xs:
            return {"mean": float("nan"), "median": float("nan"), "p99": float("nan"), "samples": []}
        return {"mean": statistics.fmean(xs), "median": statistics.median(xs),
                "p99": float(np.percentile(xs, 99)), "samples": xs}

    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "ttft_s": stats([r.ttft for r in ok]),
        "tpot_s": stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": stats([x for r in ok for x in r.itls]),
        "e2e_s": stats([r.latency for r in ok]),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + input_len * len(ok)) / duration,
    }


def store_rows(summary: dict, workload: dict, info: dict) -> str:
    """Rows for results.store: latency figures with their samples, throughputs as single values."""
    from results.store import append_rows

    rows = []
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = summary[metric]
        rows.append({"metric": metric, "unit": "s", "direction": "minimize", "samples": s["samples"],
                     "extra": {"mean": s["mean"]}})
    for metric, unit in (("request_throughput", "req/s"), ("output_throughput", "tokens/s"),
                         ("total_token_throughput", "tokens/s")):
        rows.append({"metric": metric, "unit": unit, "direction": "maximize", "samples": [summary[metric]]})
    common = {"model": info["model"], "format": info["dtype"], "workload": workload, "knobs": info["knobs"],
              "status": "ok" if not summary["failed"] else "failed",
              "error": "; ".join(summary["errors"]) or None}
    return str(append_rows([{**common, **r} for r in rows], suite="serving"))


def report(summary: dict, workload: dict) -> str:
    ms = lambda s: f"mean {s['mean'] * 1e3:8.1f}  median {s['median'] * 1e3:8.1f}  p99 {s['p99'] * 1e3:8.1f} ms"  # noqa: E731
    return "\n".join([
        f"concurrency {workload['concurrency']}, rate {workload['request_rate'] or 'max'}: "
        f"{summary['completed']} ok, {summary['failed']} failed in {summary['duration_s']:.1f} s",
        f"  TTFT  {ms(summary['ttft_s'])}",
        f"  TPOT  {ms(summary['tpot_s'])}",
        f"  ITL   {ms(summary['itl_s'])}",
        f"  throughput {summary['request_throughput']:.3f} req/s, {summary['output_throughput']:.2f} output tokens/s, "
        f"{summary['total_token_throughput']:.2f} total tokens/s",
    ])


def launch(args):
    """Start `moetune serve` on a free loopback port; returns (process, url)."""
    from suites.live_server import ServerProcess

    extra = [x for k in args.knob or [] for x in ("--knob", k)]
    srv = ServerProcess(["--model", args.launch, "--dtype", args.dtype, *extra])
    return srv.wait_ready(timeout=600), srv.url


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m suites.serving", description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server on loopback, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", metavar="MODEL", help="start `moetune serve --model MODEL` for the run")
    ap.add_argument("--dtype", default="bfloat16", help="with --launch")
    ap.add_argument("--knob", action="append", metavar="NAME=VALUE", help="with --launch")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1], help="one run per value")
    ap.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second (0: back to back)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-store", action="store_true", help="do not append rows to the result store")
    ap.add_argument("--json", action="store_true", help="one JSON object per run on stdout (no samples)")
    args = ap.parse_args(argv)
    srv, url = launch(args) if args.launch else (None, args.url)
    try:
        host, port = loopback_target(url)
        info = get_json(host, port, "/info")
        prompts = make_prompts(args.num_prompts, args.input_len, info["vocab_size"], args.seed)
        send(host, port, info["model"], prompts[0][:8], 2)  # warm-up
        for c in args.concurrency:
            workload = {"input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
                        "concurrency": c, "request_rate": args.request_rate, "seed": args.seed}
            results, duration = run_load(host, port, info["model"], prompts, args.output_len, c,
                                         args.request_rate, args.seed)
            summary = summarize(results, duration, args.input_len)
            where_stored = None if args.no_store else store_rows(summary, workload, info)
            if args.json:
                slim = {k: ({kk: vv for kk, vv in v.items() if kk != "samples"} if isinstance(v, dict) else v)
                        for k, v in summary.items()}
                print(json.dumps({"workload": workload, **slim, "stored": where_stored}))
            else:
                print(report(summary, workload) + (f"\n  rows: {where_stored}" if where_stored else ""))
    finally:
        if srv is not None:
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
