"""Per-call kernel choices: a profile's [kernel_tables] resolved per layer shape when the model loads.

A table is a list of rows per kernel-tier op; a row names the weight format, optionally the shape
it was tuned on, the bucket (tokens; for MLA decode batch and context) and knob values:

    [[kernel_tables.linear]]
    format = "int8"   n = 2048   k = 7168   tokens = 16   cpu_micro_tokens = 4   cpu_linear_block_n = 32

| table op               | backend op        | shape fields          | bucket fields   |
|------------------------|-------------------|-----------------------|-----------------|
| linear                 | linear            | n, k                  | tokens          |
| fused_moe              | fused_moe         | experts, inter, hidden, topk | tokens   |
| cpu_mla_decode         | mla_decode        | heads, rank, rope     | batch, context  |
| cpu_extend_attention   | extend_attention  | heads, dk, dv         | tokens          |

A row without shape fields applies to every shape of its op and format (a generic table); rows
with the call site's exact shape win over generic ones. A call takes the row whose bucket is
nearest (distance in log2 of each bucket field, as tuner.kernel_tier.lookup), found once per
distinct bucket value and memoized, so a call pays a dict lookup.

Precedence of each knob: default < profile [knobs] < table row < command line (--knob / LLM(knobs=)).
Only the "cpu" backend takes per-call tables; `TunedOps` passes the chosen knobs to its calls.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.errors import MoetuneError
from engine.knobs import CATALOGUE
from kernels.cpu_knobs import OP_KNOBS

# table op → (backend op, shape fields, bucket fields)
TABLE_OPS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "linear": ("linear", ("n", "k"), ("tokens",)),
    "fused_moe": ("fused_moe", ("experts", "inter", "hidden", "topk"), ("tokens",)),
    "cpu_mla_decode": ("mla_decode", ("heads", "rank", "rope"), ("batch", "context")),
    "cpu_extend_attention": ("extend_attention", ("heads", "dk", "dv"), ("tokens",)),
    "cpu_paged_decode": ("paged_decode", ("heads", "kv_heads", "dk", "dv"), ("batch", "context")),
    "cpu_paged_extend": ("paged_extend", ("heads", "kv_heads", "dk", "dv"), ("tokens",)),
}
BACKEND_TO_TABLE = {v[0]: k for k, v in TABLE_OPS.items()}
FORMATS = ("f32", "bf16", "int8", "fp8", "int4")
SOURCES = ("default", "profile", "table", "command line")


def check_tables(tables: dict, where: str = "the profile") -> None:
    """One clear MoetuneError for a table that names an unknown op, format, field or knob, or holds
    a value outside its knob's range. Ops of other backends (cuda_*) are checked for knobs only."""
    if not isinstance(tables, dict):
        raise MoetuneError(f"{where}: [kernel_tables] must be a table of ops")
    for op, rows in tables.items():
        cuda = op.startswith("cuda_")
        if op not in TABLE_OPS and not cuda:
            raise MoetuneError(f"{where}: kernel table of unknown op {op!r} "
                               f"(known: {', '.join(TABLE_OPS)}, and the cuda_* ops)")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise MoetuneError(f"{where}: kernel table {op!r} must be a list of rows")
        fields = set() if cuda else set(TABLE_OPS[op][1] + TABLE_OPS[op][2])
        for i, row in enumerate(rows):
            here = f"{where}: kernel table {op!r} row {i}"
            fmt = row.get("format")
            if not cuda and fmt not in FORMATS:
                raise MoetuneError(f"{here}: format {fmt!r} is not one of {', '.join(FORMATS)}")
            for key, value in row.items():
                if key == "format":
                    continue
                if key in fields or (cuda and key in ("tokens", "batch", "context")):
                    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                        raise MoetuneError(f"{here}: {key} = {value!r} is not a positive integer")
                    continue
                knob = CATALOGUE.get(key)
                if knob is None:
                    raise MoetuneError(f"{here}: unknown knob or field {key!r}")
                if not cuda and key not in OP_KNOBS[TABLE_OPS[op][0]]:
                    raise MoetuneError(f"{here}: knob {key} is not read by the {TABLE_OPS[op][0]} kernel "
                                       f"(it reads {', '.join(OP_KNOBS[TABLE_OPS[op][0]])})")
                try:
                    knob.validate(value)
                except MoetuneError as e:
                    raise MoetuneError(f"{here}: {e}") from None


@dataclass
class Choice:
    """What one bucket of a call site runs with."""

    bucket: dict  # the table row's bucket fields ({}: no table row, the defaults for every bucket)
    values: dict  # knob → value, every knob the op reads
    sources: dict  # knob → one of SOURCES
    arg: Any = None  # what the backend's `knobs=` takes (a prebuilt struct, or a dict)


@dataclass
class SitePlan:
    """One call site (an op on one weight shape and format): its choices by bucket."""

    op: str  # backend op
    format: str
    shape: dict
    choices: list[Choice]
    bucket_fields: tuple[str, ...]
    names: list = field(default_factory=list)  # the weights (checkpoint keys) this site serves
    _memo: dict = field(default_factory=dict, repr=False)

    def choice(self, *bucket: int) -> Choice:
        """The choice for a call with these bucket values (nearest tuned bucket)."""
        hit = self._memo.get(bucket)
        if hit is None:
            hit = self._memo[bucket] = self._nearest(bucket)
        return hit

    def _nearest(self, bucket: tuple) -> Choice:
        if len(self.choices) == 1:
            return self.choices[0]

        def distance(c: Choice) -> float:
            return sum(abs(math.log2(max(1, c.bucket[f])) - math.log2(max(1, v)))
                       for f, v in zip(self.bucket_fields, bucket))

        return min(self.choices, key=distance)

    def describe(self) -> str:
        return f"{self.op} {self.format} " + "×".join(f"{k}{v}" for k, v in self.shape.items())


def knob_sources(profile_knobs: dict, command_line: dict) -> dict:
    """Where each resolved knob's value comes from (before kernel tables)."""
    return {name: "command line" if name in command_line else "profile" if name in profile_knobs else "default"
            for name in CATALOGUE}


def build_site(op: str, fmt: str, shape: dict, tables: dict, knobs: dict, sources: dict,
               make_arg: Callable[[dict], Any] | None = None) -> SitePlan:
    """The plan of one call site from the tables and the resolved knobs."""
    table_op = BACKEND_TO_TABLE[op]
    _, shape_fields, bucket_fields = TABLE_OPS[table_op]
    rows = [r for r in tables.get(table_op, []) if r.get("format") == fmt]
    exact = [r for r in rows if all(r.get(f) == shape.get(f) for f in shape_fields)]
    generic = [r for r in rows if not any(f in r for f in shape_fields)]
    rows = exact or generic
    names = OP_KNOBS[op]
    base = {n: knobs[n] for n in names}
    choices = []
    for row in rows or [{}]:
        values, src = dict(base), {n: sources[n] for n in names}
        for n in names:
            if n in row and sources[n] != "command line":
                values[n], src[n] = row[n], "table"
        bucket = {f: row[f] for f in bucket_fields if f in row} if row else {}
        if row and len(bucket) != len(bucket_fields):
            raise MoetuneError(f"kernel table {table_op!r}: a row for {fmt} lacks its bucket "
                               f"({', '.join(bucket_fields)}): {row}")
        changed = {n: v for n, v in values.items() if src[n] == "table"}
        choices.append(Choice(bucket, values, src, make_arg(values) if make_arg else (changed or None)))
    return SitePlan(op, fmt, dict(shape), choices, bucket_fields)


class TunedOps:
    """A kernel backend wrapper: each call of linear / fused_moe / mla_decode / extend_attention /
    paged_decode / paged_extend gets the knobs its call site's plan chooses for its bucket (other
    ops pass through).

    Weight-bearing sites are keyed by the weight object (resolved at load); attention sites by the
    shape of the call (resolved on first sight of each shape, then memoized)."""

    def __init__(self, ops, weight_sites: dict[int, SitePlan], attention_site: Callable[[str, tuple], SitePlan | None]):
        self._ops, self._weight_sites, self._attention_site = ops, weight_sites, attention_site
        self._attn: dict = {}
        self._lens, self._context = None, 0  # the step's sequence lengths (one tensor for every layer)

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    @property
    def backend(self):
        """The wrapped kernel backend module."""
        return self._ops

    def weight_choice(self, weight, tokens: int) -> Choice | None:
        """The choice of a weight-bearing call site for `tokens` rows (None: the weight has no site)."""
        site = self._weight_sites.get(id(weight))
        return None if site is None else site.choice(tokens)

    def attention_choice(self, op: str, key: tuple, *bucket: int) -> Choice | None:
        """The choice of an attention call site (op, its shape key) for its bucket values."""
        site = self.attention_site(op, key)
        return None if site is None else site.choice(*bucket)

    def linear(self, x, weight):
        choice = self.weight_choice(weight, x.shape[0])
        if choice is None:
            return self._ops.linear(x, weight)
        return self._ops.linear(x, weight, knobs=choice.arg)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids):
        choice = self.weight_choice(w13, x.shape[0])
        if choice is None:
            return self._ops.fused_moe(x, w13, w2, topk_weights, topk_ids)
        return self._ops.fused_moe(x, w13, w2, topk_weights, topk_ids, knobs=choice.arg)

    def attention_site(self, op: str, key: tuple) -> SitePlan | None:
        k = (op, key)
        if k not in self._attn:
            self._attn[k] = self._attention_site(op, key)
        return self._attn[k]

    def mla_decode(self, q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, new_rows=None, slots=None):
        site = self.attention_site("mla_decode", (q_lat.shape[1], q_lat.shape[2], q_pe.shape[2]))
        if site is None:
            return self._ops.mla_decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, new_rows, slots)
        arg = site.choice(q_lat.shape[0], self._step_context(seq_lens)).arg
        return self._ops.mla_decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, new_rows, slots, knobs=arg)

    def _step_context(self, seq_lens) -> int:
        if seq_lens is not self._lens:  # once per step, not per layer
            self._lens, self._context = seq_lens, int(seq_lens.max())
        return self._context

    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale):
        site = self.attention_site("paged_decode", (q.shape[1], k_cache.shape[2], q.shape[2], v_cache.shape[3]))
        if site is None:
            return self._ops.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
        arg = site.choice(q.shape[0], self._step_context(seq_lens)).arg
        return self._ops.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, knobs=arg)

    def paged_extend(self, q, k_cache, v_cache, block_table, kv_len, scale):
        site = self.attention_site("paged_extend", (q.shape[1], k_cache.shape[2], q.shape[2], v_cache.shape[3]))
        if site is None:
            return self._ops.paged_extend(q, k_cache, v_cache, block_table, kv_len, scale)
        return self._ops.paged_extend(q, k_cache, v_cache, block_table, kv_len, scale, knobs=site.choice(q.shape[0]).arg)

    def extend_attention(self, q, k, v, scale):
        site = self.attention_site("extend_attention", (q.shape[1], q.shape[2], v.shape[2]))
        if site is None:
            return self._ops.extend_attention(q, k, v, scale)
        return self._ops.extend_attention(q, k, v, scale, knobs=site.choice(q.shape[0]).arg)


def attention_shape(op: str, key: tuple) -> dict:
    fields = TABLE_OPS[BACKEND_TO_TABLE[op]][1]
    return dict(zip(fields, key))


def plan_rows(sites: list[SitePlan]) -> list[dict]:
    """Every site × bucket × knob: what runs and where it came from (`moetune explain`, /info)."""
    out = []
    for s in sites:
        for c in s.choices:
            bucket = ", ".join(f"{k} {v}" for k, v in c.bucket.items()) or "every bucket"
            out.append({"op": s.op, "format": s.format, "shape": dict(s.shape), "bucket": dict(c.bucket),
                        "bucket_text": bucket, "knobs": dict(c.values), "sources": dict(c.sources)})
    return out
