"""Server metrics in the Prometheus text format: requests, tokens, queue length, KV use, and
histograms of time to first token, inter-token latency and request latency.

Written by the engine thread, read by the HTTP thread: every update and the rendering hold one lock.
"""
from __future__ import annotations

import bisect
import threading

# Seconds: sub-millisecond steps of tiny models up to minutes-long prefills of huge ones.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   25.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip(list(self.buckets) + ["+Inf"], self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {total}"]


def _block(name: str, kind: str, help_: str, lines: list[str]) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = 0
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft, self.itl, self.e2e = Histogram(), Histogram(), Histogram()
        self.state = {"waiting": 0, "running": 0, "kv_used": 0, "kv_total": 0, "preemptions": 0}

    # ------------------------------------------------------------ updates (engine thread)

    def on_arrival(self, prompt_tokens: int) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens

    def on_token(self, ttft: float | None, itl: float | None) -> None:
        with self._lock:
            self.generation_tokens += 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None:
                self.itl.observe(itl)

    def on_finish(self, reason: str, latency: float) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(latency)

    def set_state(self, scheduler) -> None:
        state = {"waiting": len(scheduler.waiting), "running": len(scheduler.running),
                 "kv_used": scheduler.kv_blocks_used(), "kv_total": scheduler.cache.allocator.num_blocks,
                 "preemptions": scheduler.num_preemptions}
        with self._lock:
            self.state = state

    # ------------------------------------------------------------ reading (HTTP thread)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.state)

    def render(self) -> str:
        with self._lock:
            s = self.state
            use = s["kv_used"] / s["kv_total"] if s["kv_total"] else 0.0
            finished = [f'moetune_requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(self.finished.items())]
            lines = [
                *_block("moetune_requests_total", "counter", "requests received", [f"moetune_requests_total {self.requests}"]),
                *_block("moetune_requests_finished_total", "counter", "requests ended, by finish reason", finished),
                *_block("moetune_prompt_tokens_total", "counter", "prompt tokens received",
                        [f"moetune_prompt_tokens_total {self.prompt_tokens}"]),
                *_block("moetune_generation_tokens_total", "counter", "tokens generated",
                        [f"moetune_generation_tokens_total {self.generation_tokens}"]),
                *_block("moetune_requests_waiting", "gauge", "requests queued (not holding KV cache)",
                        [f"moetune_requests_waiting {s['waiting']}"]),
                *_block("moetune_requests_running", "gauge", "requests holding KV cache",
                        [f"moetune_requests_running {s['running']}"]),
                *_block("moetune_preemptions_total", "counter", "requests preempted (to be recomputed)",
                        [f"moetune_preemptions_total {s['preemptions']}"]),
                *_block("moetune_kv_blocks_used", "gauge", "KV-cache blocks in use", [f"moetune_kv_blocks_used {s['kv_used']}"]),
                *_block("moetune_kv_blocks_total", "gauge", "KV-cache blocks", [f"moetune_kv_blocks_total {s['kv_total']}"]),
                *_block("moetune_kv_usage_ratio", "gauge", "fraction of KV-cache blocks in use", [f"moetune_kv_usage_ratio {use}"]),
                *_block("moetune_time_to_first_token_seconds", "histogram", "arrival to first token",
                        self.ttft.lines("moetune_time_to_first_token_seconds")),
                *_block("moetune_inter_token_latency_seconds", "histogram", "time between successive tokens",
                        self.itl.lines("moetune_inter_token_latency_seconds")),
                *_block("moetune_request_latency_seconds", "histogram", "arrival to the last token",
                        self.e2e.lines("moetune_request_latency_seconds")),
            ]
        return "\n".join(lines) + "\n"
