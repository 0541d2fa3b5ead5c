"""Per-call kernel tables (engine/kernel_tables.py): validation, precedence, nearest bucket, and the
LLM's call sites on the tiny preset."""
import pytest

from engine import kernel_tables as kt
from engine.errors import MoetuneError
from engine.knobs import CATALOGUE, resolve_knobs


def _site(tables, knobs=None, profile=None, cli=None, op="linear", fmt="int8", shape=None):
    cli = cli or {}
    values = resolve_knobs({**(profile or {}), **cli})
    sources = kt.knob_sources(profile or {}, cli)
    return kt.build_site(op, fmt, shape or {"n": 64, "k": 128}, tables, values, sources)


TABLE = {"linear": [
    {"format": "int8", "n": 64, "k": 128, "tokens": 1, "cpu_micro_rows": 8},
    {"format": "int8", "n": 64, "k": 128, "tokens": 16, "cpu_micro_tokens": 4, "cpu_linear_block_n": 16},
    {"format": "int8", "n": 64, "k": 128, "tokens": 512},  # defaults were best here
    {"format": "int8", "tokens": 1, "cpu_micro_rows": 4, "cpu_task_chunk": 8},  # generic: any shape
    {"format": "bf16", "n": 64, "k": 128, "tokens": 1, "cpu_task_chunk": 2},
]}


def test_nearest_bucket_in_log2():
    site = _site(TABLE)
    assert [c.bucket for c in site.choices] == [{"tokens": 1}, {"tokens": 16}, {"tokens": 512}]
    assert site.choice(1).values["cpu_micro_rows"] == 8
    assert site.choice(3).values["cpu_micro_rows"] == 8  # log2 3 = 1.58: nearer 1 than 16
    assert site.choice(5).values["cpu_micro_tokens"] == 4  # nearer 16
    assert site.choice(200).bucket == {"tokens": 512}
    assert site.choice(200) is site.choice(200)  # memoized
    # the knobs a row leaves out keep their resolved value
    assert site.choice(1).values["cpu_micro_tokens"] == CATALOGUE["cpu_micro_tokens"].default


def test_exact_shape_rows_win_over_generic_and_formats_stay_apart():
    assert _site(TABLE).choice(1).values["cpu_task_chunk"] == CATALOGUE["cpu_task_chunk"].default
    other = _site(TABLE, shape={"n": 32, "k": 128})  # no exact rows: the generic ones
    assert [c.bucket for c in other.choices] == [{"tokens": 1}]
    assert other.choice(400).values["cpu_task_chunk"] == 8
    assert _site(TABLE, fmt="bf16").choice(7).values["cpu_task_chunk"] == 2
    none = _site(TABLE, fmt="fp8")
    assert len(none.choices) == 1 and none.choices[0].bucket == {} and none.choices[0].arg is None
    assert set(none.choices[0].sources.values()) == {"default"}


def test_precedence_default_profile_table_command_line():
    site = _site(TABLE, profile={"cpu_micro_rows": 8, "cpu_gemm_block_n": 512, "cpu_linear_block_n": 128},
                 cli={"cpu_linear_block_n": 32})
    c16 = site.choice(16)
    assert c16.values["cpu_micro_tokens"] == 4 and c16.sources["cpu_micro_tokens"] == "table"
    assert c16.values["cpu_gemm_block_n"] == 512 and c16.sources["cpu_gemm_block_n"] == "profile"
    assert c16.values["cpu_linear_block_n"] == 32 and c16.sources["cpu_linear_block_n"] == "command line"
    assert c16.values["cpu_gemm_min_tokens"] == CATALOGUE["cpu_gemm_min_tokens"].default
    assert c16.sources["cpu_gemm_min_tokens"] == "default"
    assert c16.arg == {"cpu_micro_tokens": 4}  # only what the table changes travels with the call


def test_only_the_knobs_an_op_reads():
    site = _site({}, op="fused_moe", fmt="int8", shape={"experts": 8, "inter": 32, "hidden": 64, "topk": 2})
    assert "cpu_moe_block_n" in site.choices[0].values and "cpu_linear_block_n" not in site.choices[0].values
    attn = _site({}, op="mla_decode", fmt="bf16", shape={"heads": 4, "rank": 32, "rope": 8})
    assert set(attn.choices[0].values) == set(kt.OP_KNOBS["mla_decode"])


@pytest.mark.parametrize("tables, message", [
    ({"matmul": []}, "unknown op 'matmul'"),
    ({"linear": {"format": "int8"}}, "must be a list of rows"),
    ({"linear": [{"format": "int9", "tokens": 1}]}, "format 'int9'"),
    ({"linear": [{"format": "int8", "tokens": 0}]}, "tokens = 0 is not a positive integer"),
    ({"linear": [{"format": "int8", "tokens": 1, "cpu_micro_rowz": 4}]}, "unknown knob or field 'cpu_micro_rowz'"),
    ({"linear": [{"format": "int8", "tokens": 1, "cpu_micro_rows": 5}]}, "cpu_micro_rows: 5 is not one of"),
    ({"linear": [{"format": "int8", "tokens": 1, "cpu_linear_block_n": 4096}]}, "outside"),
    ({"linear": [{"format": "int8", "tokens": 1, "cpu_moe_block_n": 16}]}, "not read by the linear kernel"),
    ({"cpu_mla_decode": [{"format": "bf16", "batch": 1, "context": 2, "cpu_micro_rows": 4}]}, "not read"),
    ({"cuda_fp8_linear": [{"format": "fp8", "tokens": 16, "cuda_fp8_gemm_block_m": 3}]}, "cuda_fp8_gemm_block_m"),
])
def test_bad_tables_give_one_clear_error(tables, message):
    with pytest.raises(MoetuneError, match=message):
        kt.check_tables(tables, "profile x.toml")


def test_row_without_its_bucket_is_refused():
    with pytest.raises(MoetuneError, match="lacks its bucket"):
        _site({"linear": [{"format": "int8", "n": 64, "k": 128, "cpu_micro_rows": 8}]})


def test_plan_rows_describe_every_bucket():
    rows = kt.plan_rows([_site(TABLE)])
    assert [r["bucket_text"] for r in rows] == ["tokens 1", "tokens 16", "tokens 512"]
    assert rows[0]["sources"]["cpu_micro_rows"] == "table" and rows[0]["shape"] == {"n": 64, "k": 128}
