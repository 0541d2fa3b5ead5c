"""`moetune bench kernels`: its case list, and a one-repeat smoke run of the attention ops on tiny
settings (the machine's limits stubbed, nothing stored): bytes, flops and context as documented."""
import io
import json

import pytest

import suites.kernels as suite
from kernels.cpu_build import missing_isa


def test_default_cases_per_op():
    weight_ops = list(suite.cases(["linear"], ["int8"], None, "small", 32))
    assert [c[3] for c in weight_ops] == [t for _ in suite.linear_shapes("small") for t in suite.WEIGHT_TOKENS]
    assert all(c[4] is None for c in weight_ops)
    mla = list(suite.cases(["mla_decode"], ["int8"], None, "all", 32))
    assert {(c[1].h, c[2], c[3], c[4]) for c in mla} == {(h, "bf16", b, ctx) for h in (16, 128) for b in (1, 4, 16)
                                                        for ctx in suite.CONTEXTS}
    extend = list(suite.cases(["extend"], ["bf16"], [7], "small", 32, prefixes=[0, 3]))
    assert [(c[1].dk, c[1].dv, c[3], c[4]) for c in extend] == [(192, 128, 7, 0), (192, 128, 7, 3)]
    gqa = list(suite.cases(["paged_decode"], ["int8"], [1], "all", 32, contexts=[512]))
    assert [(c[1].h, c[1].hkv, c[1].dk, c[2]) for c in gqa] == [(32, 4, 128, "bf16"), (32, 8, 64, "bf16"),
                                                                 (16, 16, 128, "bf16"), (64, 4, 128, "bf16")]


@pytest.mark.skipif(bool(missing_isa()), reason="the cpu kernels cannot run here")
def test_attention_rows(monkeypatch):
    import tuner.probe

    monkeypatch.setattr(tuner.probe, "probe", lambda: {"read_gbps": 10.0, "fp32_fma_gflops": 100.0})
    monkeypatch.setattr(suite, "POOL_BYTES", 1 << 20)
    out = io.StringIO()
    rows = suite.run(["mla_decode", "paged_decode", "extend"], ["int8"], [2], "small", repeats=1, store=False,
                     out=out, as_json=True, contexts=[70], prefixes=[5])
    mla, *gqa, ext = rows
    assert (mla["context"], mla["bytes"], mla["format"]) == (70, 2 * 70 * 576 * 2, "bf16")
    assert mla["gflops"] * 1e9 * mla["median_s"] == pytest.approx(2 * 70 * 16 * (2 * 576 + 2 * 512))
    q3 = gqa[0]  # Qwen3-MoE's 32 query / 4 KV heads of 128 dims
    assert (q3["context"], q3["bytes"]) == (70, 2 * 70 * 4 * 256 * 2) and "Hkv=4" in q3["shape"]
    assert q3["gflops"] * 1e9 * q3["median_s"] == pytest.approx(2 * 70 * 32 * 4 * 128)
    assert ext["context"] == 7 and ext["gflops"] * 1e9 * ext["median_s"] == pytest.approx(2 * 16 * 320 * (2 * 5 + 3))
    assert all(r["speedup_vs_torch"] > 0 and r["fraction_of_peak_flops"] > 0 for r in rows)
    assert [json.loads(line)["op"] for line in out.getvalue().splitlines()] == ["mla_decode"] + ["paged_decode"] * 3 + [
        "extend"]


# ------------------------------------------------------------------ the A/B and row-length tools


def test_moe_ab_variants_parse_and_bad_ones_are_refused(capsys):
    from suites import moe_ab

    assert moe_ab.parse_variant("int8") == ("int8", {})
    assert moe_ab.parse_variant("fp8:cpu_fp8_method=vector,cpu_moe_block_n=64") == (
        "fp8", {"cpu_fp8_method": "vector", "cpu_moe_block_n": 64})
    for bad in ("int3", "int8:cpu_moe_block_n"):
        with pytest.raises(ValueError):
            moe_ab.parse_variant(bad)
    assert moe_ab.parse_variant("int8:cpu_huge_pages=true")[1] == {"cpu_huge_pages": True}
    assert moe_ab.main(["--tokens", "0", "int8"]) == 2
    assert "must be ≥ 1" in capsys.readouterr().err


def test_moe_ab_prepares_weights_per_load_knob_and_restores_the_defaults():
    """A load-time knob (cpu_huge_pages) acts in prepare(): variants differing in one get their own
    weights, prepared under it; per-call knobs share one set."""
    from suites import moe_ab

    assert moe_ab.weight_key("int8", {"cpu_moe_block_n": 64}) == moe_ab.weight_key("int8", {})
    assert moe_ab.weight_key("int8", {"cpu_huge_pages": True}) != moe_ab.weight_key("int8", {})

    class FakeCpu:
        _knobs = {"cpu_huge_pages": False}
        seen = []

        def configure(self, values):
            self._knobs = {**self._knobs, **values}
            self.seen.append(dict(self._knobs))

    cpu = FakeCpu()
    with moe_ab.load_knobs(cpu, {"cpu_huge_pages": True}):
        assert cpu._knobs["cpu_huge_pages"] is True
    assert cpu._knobs["cpu_huge_pages"] is False


@pytest.mark.parametrize("variants", [1, 2, 3, 4])
def test_moe_ab_never_routes_a_call_to_the_experts_of_the_call_before(variants):
    """Variants of one format share their weights: a call on the routing of the call just before it would
    read its experts from the last-level cache (measured: the later of two identical variants 1.4x faster)."""
    from suites import moe_ab
    from suites.kernels import ROUTINGS

    calls = [moe_ab.call_routing(r, j, variants) for r in range(40) for j in range(variants)]
    assert all(a != b for a, b in zip(calls, calls[1:]))
    assert all(0 <= c < ROUTINGS * variants for c in calls)
    for j in range(variants):  # each variant its own ROUTINGS routings, each used as often
        mine = [moe_ab.call_routing(r, j, variants) for r in range(8 * ROUTINGS)]
        assert len(set(mine)) == ROUTINGS and all(mine.count(c) == 8 for c in set(mine))


def test_moe_ab_runs_before_each_call_untimed(monkeypatch):
    """The flush read (alternate's `before`) runs ahead of every call, warm-ups included, and outside its time
    (a fake clock: `before` advances it by 1 s, a call by 1 ms, so each timed call must read exactly 1 ms)."""
    import types

    from suites import moe_ab

    clock = [0.0]
    monkeypatch.setattr(moe_ab, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    log = []

    def call(r, j):
        log.append(("call", r, j))
        clock[0] += 1e-3

    def before():
        log.append(("before",))
        clock[0] += 1.0

    times = moe_ab.alternate(call, 2, 3, before=before)
    assert log[0::2] == [("before",)] * 10 and [e[1:] for e in log[1::2]] == [(r, j) for r in range(5) for j in range(2)]
    assert len(times) == 2 and all(len(t) == 3 and all(abs(x - 1e-3) < 1e-9 for x in t) for t in times)


@pytest.mark.skipif(bool(missing_isa()), reason="the cpu kernels cannot run here")
def test_moe_ab_builds_each_variants_knob_struct_once():
    """The per-call knobs go to the kernels as a struct built once per variant (a dict is converted at every call,
    ≈ 20 µs, timed with the kernel); the load-time ones stay out of it (they acted at prepare())."""
    import kernels.cpu as cpu
    from suites import moe_ab

    parsed = [moe_ab.parse_variant(v) for v in ("int8", "int8:cpu_prefetch_hint=t0,cpu_huge_pages=false",
                                               "fp8:cpu_r16_fp8_rows=32")]
    structs = moe_ab.call_knobs(cpu, parsed)
    assert all(isinstance(k, cpu._ext.Knobs) for k in structs)
    default = cpu.make_knobs()
    assert structs[0].prefetch_hint == default.prefetch_hint and structs[0].r16_fp8_rows == default.r16_fp8_rows
    assert structs[1].prefetch_hint == cpu.make_knobs({"cpu_prefetch_hint": "t0"}).prefetch_hint != default.prefetch_hint
    assert structs[2].r16_fp8_rows == 32 != default.r16_fp8_rows
    with pytest.raises(ValueError, match="cpu_r16_fp8_rows"):
        moe_ab.call_knobs(cpu, [("fp8", {"cpu_r16_fp8_rows": "many"})])


@pytest.mark.skipif(bool(missing_isa()), reason="the cpu kernels cannot run here")
def test_moe_ab_linear_goes_round_copies_out_of_the_cache(monkeypatch, capsys):
    """--linear N,K: each variant's calls go round copies of its weight (4x the last-level cache in all),
    each call checked to run; a bad N,K is one clear error."""
    import kernels.cpu as cpu
    import suites.kernels
    from suites import moe_ab

    monkeypatch.setattr(suites.kernels, "last_level_cache_bytes", lambda: 64 << 10)
    prepared = []
    real = cpu.prepare
    monkeypatch.setattr(cpu, "prepare", lambda w: prepared.append(w) or real(w))
    rows = moe_ab.run_linear(96, 256, 3, 4, ["int8", "int8:cpu_prefetch_hint=t0", "bf16"])
    assert [r["variant"] for r in rows] == ["int8", "int8:cpu_prefetch_hint=t0", "bf16"]
    assert all(r["median_s"] > 0 and r["gbps"] > 0 for r in rows) and rows[0]["speed_vs_first"] == 1.0
    # int8: 96 x 256 bytes (+ scales) -> 4 x 64 KiB / ~25 KiB = 11 copies; bf16 (48 KiB) -> 6: one set per format
    assert len(prepared) == 11 + 6
    assert "linear [96, 256]  T=3" in capsys.readouterr().out
    assert moe_ab.main(["--linear", "96x256", "int8"]) == 2
    assert "expected N,K" in capsys.readouterr().err


@pytest.mark.skipif(bool(missing_isa()), reason="the cpu kernels cannot run here")
def test_rowlen_sweep_reads_the_same_bytes_at_each_length(capsys):
    from suites import rowlen

    rows = rowlen.sweep(["int8", "int4"], [64, 256], mib=1, repeats=2)
    assert [(r["format"], r["k"]) for r in rows] == [("int8", 64), ("int8", 256), ("int4", 64), ("int4", 256)]
    assert all(r["median_s"] > 0 and r["p10_s"] <= r["p90_s"] and r["gbps"] > 0 for r in rows)
    assert {r["row_bytes"] for r in rows if r["format"] == "int4"} == {32, 128}
    assert "GB/s" in capsys.readouterr().out
    assert rowlen.main(["--mib", "0"]) == 2


def test_linear_cases_stream_their_weight_from_dram(monkeypatch):
    """A linear case below 64 tokens cycles through copies of its weight that together exceed twice
    the last-level cache (and the pool size), one call per copy in turn, ours and torch's each their own."""
    monkeypatch.setattr(suite, "POOL_BYTES", 1 << 20)
    monkeypatch.setattr(suite, "last_level_cache_bytes", lambda: 3 << 20)
    assert suite.weight_copies(1 << 20) == 6 and suite.weight_copies(5 << 20) == 2 and suite.weight_copies(64 << 20) == 1
    assert suite.weight_nbytes(suite.LinearShape("x", 1024, 512), "int4") == 1024 * 256
    monkeypatch.undo()  # the real one reads sysfs
    assert suite.last_level_cache_bytes() >= 32 << 10


@pytest.mark.skipif(bool(missing_isa()), reason="the cpu kernels cannot run here")
def test_linear_case_cycles_through_distinct_copies(monkeypatch):
    import kernels.cpu as cpu
    import tuner.probe

    monkeypatch.setattr(tuner.probe, "probe", lambda: {"read_gbps": 10.0, "fp32_fma_gflops": 100.0})
    monkeypatch.setattr(suite, "POOL_BYTES", 1 << 20)
    monkeypatch.setattr(suite, "last_level_cache_bytes", lambda: 1 << 20)
    seen, real = [], cpu.linear
    monkeypatch.setattr(cpu, "linear", lambda x, w, knobs=None: seen.append(id(w)) or real(x, w, knobs))
    g = __import__("torch").Generator().manual_seed(0)
    suite.bench_linear(suite.LinearShape("t", 256, 512), "int8", 1, 4, g)  # 128 KiB a copy: 16 copies
    # rounds 0 (recorded warm-up), 1 (warm-up), then 0..3 timed: round r takes copy r (16 copies here)
    assert len(seen) == 6 and seen[0] == seen[2] and seen[1] == seen[3] and len(set(seen)) == 4
    seen.clear()
    suite.bench_linear(suite.LinearShape("t", 256, 512), "int8", 64, 2, g)  # compute-bound: one copy
    assert len(set(seen)) == 1


@pytest.mark.skipif(bool(missing_isa()), reason="the cpu kernels cannot run here")
def test_weight_cases_carry_a_paired_read_of_the_same_bytes(monkeypatch):
    """fused_moe and linear rows time the probe's best read method in the same rounds over as many bytes,
    each round another slice of the buffer; the row's fraction of it is its GB/s over the read's."""
    import tuner.probe

    monkeypatch.setattr(tuner.probe, "probe", lambda: {"read_gbps": 10.0, "fp32_fma_gflops": 100.0,
                                                       "read_method": "4 streams x 4 lines, prefetch 1024 B"})
    monkeypatch.setattr(suite, "PAIRED_READ_BYTES", 8 << 20)
    monkeypatch.setattr(suite, "POOL_BYTES", 1 << 20)  # a few weight copies, not the real pool's thousands
    monkeypatch.setattr(suite, "last_level_cache_bytes", lambda: 1 << 20)
    read = suite.PairedRead(1 << 20)
    assert read.nbytes == 1 << 20 and read.slices == 8
    assert [read.offset(r) for r in range(9)] == [i * (1 << 18) for i in range(8)] + [0]
    assert read.methods == ["4 streams x 4 lines, prefetch 1024 B", "sequential",
                            "4 streams, prefetch 1024 B (kernels' pattern)"]
    timed = []
    real = tuner.probe.read_once
    monkeypatch.setattr(tuner.probe, "read_once",
                        lambda ext, buf, m: timed.append((m, buf.data_ptr())) or {"sequential": 0.5}.get(m, 2.0))
    assert read(3) == 0.5  # the fastest of the methods, each over a slice of its own
    assert [m for m, _ in timed] == read.methods and len({p for _, p in timed}) == 3
    monkeypatch.setattr(tuner.probe, "read_once", real)
    assert read(3) > 0
    g = __import__("torch").Generator().manual_seed(0)
    row = suite.bench_linear(suite.LinearShape("t", 256, 512), "int8", 1, 3, g)
    assert len(row["paired_read_samples"]) == 3 and row["paired_read_gbps"] > 0
    assert row["fraction_of_paired_read"] == pytest.approx(row["gbps"] / row["paired_read_gbps"])
    assert "paired read" in suite._line(row)
    with pytest.raises(ValueError, match="no read method"):
        tuner.probe.read_once(read.ext, suite.PairedRead._buf[:1024], "teleportation")


def test_a_case_above_the_probes_limit_says_the_probe_is_stale():
    rows = [{"fraction_of_read_bw": 0.8, "fraction_of_peak_flops": 0.5, "peak": "vnni"}]
    assert suite.stale_limits(rows) is None
    rows.append({"fraction_of_read_bw": 0.01, "fraction_of_peak_flops": 1.2, "peak": "vnni"})
    note = suite.stale_limits(rows)
    assert "120%" in note and "vnni peak" in note and "tuner.probe --refresh" in note
    assert "read bandwidth" in suite.stale_limits([{"fraction_of_read_bw": 1.44}])


def test_attn_ab_variants_parse_and_bad_ones_are_refused(capsys):
    from suites import attn_ab

    assert attn_ab.parse_variant("defaults") == {}
    assert attn_ab.parse_variant("cpu_attn_f32_form=packed,cpu_attn_decode_kv_block=32") == {
        "cpu_attn_f32_form": "packed", "cpu_attn_decode_kv_block": 32}
    for bad in ("cpu_attn_f32_form", "cpu_prefetch_hint=t1"):
        with pytest.raises(ValueError):
            attn_ab.parse_variant(bad)
    assert attn_ab.main(["--heads", "6,4", "defaults"]) == 2
    assert "multiple of the KV heads" in capsys.readouterr().err
    assert attn_ab.main(["--heads", "8,2", "--context", "0", "defaults"]) == 2
    assert "must be ≥ 1" in capsys.readouterr().err


@pytest.mark.skipif(bool(missing_isa()), reason="the cpu kernels cannot run here")
@pytest.mark.parametrize("mla", [False, True], ids=["gqa_8_2", "mla_4"])
def test_attn_ab_runs_every_variant_against_the_reference(mla):
    """A short warm run: one row per variant, in order, each checked against kernels.reference (float32 math
    on bf16 inputs, the output rounded to bf16: within bf16's rounding)."""
    from suites import attn_ab

    out = io.StringIO()
    args = attn_ab.argparse.Namespace(heads=None if mla else (8, 2), mla=4 if mla else None,
                                      dim=24, context=70, batch=2, block_size=16, repeats=2, calls=2, warm=True,
                                      variants=["defaults", "cpu_attn_f32_form=transpose,cpu_attn_prefetch=none"])
    rows = attn_ab.run(args, out=out)
    assert [r["variant"] for r in rows] == args.variants
    assert all(r["rel_err"] < 1e-2 and r["median_s"] > 0 and len(r["times"]) == 2 for r in rows)
    assert rows[0]["vs_first"] == 1.0 and "one warm copy" in out.getvalue()
