"""The knobs of the "cpu" kernel backend (kernels/cpu), declared once, beside their reader.

A module beside the kernels.cpu package (importing it never builds the extension). engine.knobs
collects these into the catalogue; kernels.cpu takes its defaults from here and hands every value to
the C++ kernels as a named struct (no mirrored defaults in C++).
"""
from __future__ import annotations

from kernels.knobspec import Knob

CPU_KNOBS: tuple[Knob, ...] = (
    Knob("cpu_micro_rows", int, 4, "kernels/cpu",
         "CPU matmul microkernel: weight rows per register tile", choices=(4, 8)),
    Knob("cpu_micro_tokens", int, 4, "kernels/cpu",
         "CPU matmul microkernel: tokens per register tile (each weight chunk is converted once for them; "
         "the tokens left over after whole tiles go in pairs, then one at a time)",
         choices=(1, 2, 4)),
    Knob("cpu_micro_wide", int, 6, "kernels/cpu",
         "CPU microkernels on BF16 (AVX512-BF16) and INT8 (VNNI) dot products, a sweep of at least this many "
         "tokens (prefill on the microkernel path: experts with a few tokens each): groups of this many tokens "
         "on wide register tiles (6 tokens x 4 rows, 8 or 12 x 2), so each weight chunk is loaded once for all "
         "of them and a tile's rows stream once for the group; the tokens left over as cpu_micro_tokens says "
         "(0: none). Measured on an AMD Zen 5 VM, 6 against 0: linear [11264, 2048] INT8 x1.41 / x1.16 / x1.06 "
         "at 6 / 8 / 12 tokens, BF16 x1.09 / x1.06 / x1.04; fused MoE `small` BF16 at 128 tokens x1.04-1.13; "
         "8 and 12 (2-row tiles) x0.92-0.98 there", choices=(0, 6, 8, 12)),
    Knob("cpu_linear_block_n", int, 64, "kernels/cpu",
         "CPU linear, few tokens: output rows per parallel task", low=8, high=1024, log=True, pow2=True),
    Knob("cpu_moe_block_n", int, 128, "kernels/cpu",
         "CPU fused MoE: rows per task (intermediate rows in gate/up, output rows in down); tasks are "
         "experts × tiles; with cpu_tile_rows=spread each of a tile's streams runs through block_n / "
         "micro_rows rows (128: INT8 `small` T=1 x1.07 over 32 on an Emerald Rapids VM)",
         low=8, high=512, log=True, pow2=True),
    Knob("cpu_moe_int4_tasks", int, 1, "kernels/cpu",
         "CPU fused MoE, INT4 experts in the r16 layout: each phase (gate/up, down) in about this many tasks per "
         "thread, of at least cpu_moe_block_n rows, an expert's rows split evenly (0: cpu_moe_block_n rows per task, "
         "as the other formats). Their 16-row decode tiles read a task's rows as one stream, which slows at each new "
         "task. AMD Zen 4 VM (python -m suites.moe_ab, alternating, two threads), 1 / 2 against 0: `small` T=1 in a "
         "fast-memory minute x1.27 / x1.21 (INT4 x1.73 / x1.66 INT8's speed, x1.38 at 0), T=4 x1.24 / x1.19, V3 T=1 "
         "x1.10 / x1.10; in memory-bound minutes x1.02-1.05; 128 tokens x1.00 / x1.09; one thread `small` x1.16. "
         "INT8, FP8 and BF16 (multi-stream tiles) gained nothing from longer tasks (x1.01-1.02 on one thread)",
         choices=(0, 1, 2, 3, 4, 6)),
    Knob("cpu_gemm_min_tokens", int, 32, "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert): from this many (BF16 on the unpack path: "
         "cpu_bf16_gemm_min_tokens), the GEMM path (per "
         "cpu_bf16_gemm / cpu_int8_gemm / cpu_int4_gemm: weight blocks unpacked to float32 for BLAS, oneDNN, the "
         "VNNI / AVX512-BF16 dot-product GEMM — from cpu_dot_gemm_min_tokens —, or AMX from "
         "cpu_amx_min_tokens) instead of the register microkernel", low=1, high=4096, log=True),
    Knob("cpu_dot_gemm_min_tokens", int, 8, "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert): from this many, a weight whose GEMM path runs a "
         "dot-product GEMM here (INT8 / INT4 on VNNI, INT8 on vpmaddubsw, BF16 on AVX512-BF16 when cpu_bf16_gemm "
         "names it; not FP8, "
         "whose blocks are expanded as they are packed: it starts at cpu_gemm_min_tokens) "
         "takes it instead of the register microkernel; it packs its own weight blocks, with no float32 "
         "unpack, so it wins from fewer rows than cpu_gemm_min_tokens' unpack + BLAS (measured: INT8 / INT4 "
         "from 8-16 rows on an Emerald Rapids VM)", low=1, high=4096, log=True),
    Knob("cpu_bf16_gemm_min_tokens", int, 256, "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert): from this many, a BF16 weight whose GEMM path is the float32 "
         "unpack + BLAS (cpu_bf16_gemm unpack, or auto without AVX512-BF16 / AMX) takes it instead of the split "
         "BF16 microkernel; where oneDNN or a dot-product GEMM runs BF16, cpu_gemm_min_tokens / "
         "cpu_dot_gemm_min_tokens decide (measured on an Emerald Rapids VM without AVX512-BF16, "
         "[11264, 2048]: the microkernel 1.70x / 1.35x / 1.20x / 1.0x / 0.92x unpack + BLAS at 32 / 64 / 128 / "
         "256 / 512 tokens)", low=1, high=4096, log=True),
    Knob("cpu_tile_rows", str, "spread", "kernels/cpu",
         "CPU microkernels: the rows one register tile reads within a sweep (a task's rows): R adjacent rows "
         "(adjacent: R short streams per tile, each one row long), or rows a sweep's rows / R apart (spread: "
         "R streams that each run through rows / R consecutive rows, one long sequential read each, as the "
         "probe's fastest reader; only where the rows split evenly). Measured on an Emerald Rapids VM, T=1: "
         "fused MoE `small` INT8 x1.16 / INT4 x1.23 / FP8 x1.26 (with cpu_moe_block_n 128), V3 INT8 x1.05, linear "
         "INT8 [4096, 2048] x1.19, 16 KiB rows x0.99", choices=("adjacent", "spread")),
    Knob("cpu_micro_order", str, "tiles", "kernels/cpu",
         "CPU microkernels, a sweep of more tokens than cpu_micro_tokens (prefill on the microkernel path, "
         "experts with a few tokens each): each token group over all the sweep's rows in turn (groups: the "
         "rows come from memory once, then from L2 for every later group), or each register tile through "
         "every group while its rows are in L1 (tiles: the next rows stream in during the later groups' "
         "arithmetic). Measured on an AMD Zen 4 VM, tiles against groups: fused MoE `small` at 12 tokens per "
         "expert BF16 x1.18, INT8 on the microkernels x1.13; BF16 linear [11264, 2048] at 16 tokens "
         "x1.15-1.3; or as tiles with the tile's second group prefetching the next tile's rows at the offset "
         "it reads (tiles_next: the memory streams while the later groups compute from L1)",
         choices=("groups", "tiles", "tiles_next")),
    Knob("cpu_prefetch_ahead", int, 2048, "kernels/cpu",
         "CPU microkernels: how many bytes ahead in its own row each weight row is prefetched, at most a "
         "row (past the row's end: the same place in the next tile's rows; a row no longer than this "
         "prefetches the next tile at the offset being read); 0: always the next tile at the offset being "
         "read (a whole tile ahead, which overruns L1 on long rows). r16 weights: ahead in a 16-row block's "
         "stream (16 rows, contiguous), at most one block (INT4 r16 on an AMD Zen 4 VM: 512 / 1024 / 2048 "
         "within 1 % at T=1)", choices=(0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)),
    Knob("cpu_r16_int4_prefetch_ahead", int, 4096, "kernels/cpu",
         "CPU microkernels on INT4 r16 weights (fused MoE experts, decode): bytes ahead in a 16-row block's stream "
         "their weight prefetch reads, in place of cpu_prefetch_ahead (0: as cpu_prefetch_ahead; at most one "
         "block). Emerald Rapids VM (AVX512-VNNI, no AVX512-BF16; python -m suites.moe_ab, alternating), 4096 "
         "against 2048: `small` T=1 x1.04-1.09 in eight runs (INT4 x1.48-1.75 INT8's speed, INT8 at 4096 x0.98), "
         "V3 x1.04-1.05, `small` T=4 x1.00; 8192 and 16384 as 4096",
         choices=(0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)),
    Knob("cpu_prefetch_hint", str, "t2", "kernels/cpu",
         "CPU microkernels: the cache level their software prefetch of weight rows (cpu_prefetch_ahead) fills: "
         "L1 (t0, prefetcht0), L2 (t1), the outer levels (t2: L3 on Intel, L2 on AMD), or none (the hardware "
         "prefetchers alone). Measured on an AMD Zen 4 VM, 2 threads, t2 against t0: BF16 / INT8 linear "
         "[11264, 2048] x1.48 / x1.41 at 1 token, x1.50 / x1.75 at 4, x1.00 / x1.05 at 16; fused MoE `small` "
         "T=1 BF16 x1.45, INT8 x1.39, INT4 x1.08, FP8 x1.02 (prefetcht0 fills L1's few miss buffers, and "
         "the loads wait behind them)", choices=("t0", "t1", "t2", "none")),
    Knob("cpu_prefill_prefetch_hint", str, "t0", "kernels/cpu",
         "CPU microkernels, a sweep of more than one token group (prefill on the microkernel path: experts "
         "with a few tokens each, where every later group reads a tile's rows again from L1): the cache level "
         "of its weight rows' software prefetch, as cpu_prefetch_hint, with cpu_prefill_prefetch_ahead as its "
         "distance; same: cpu_prefetch_hint and cpu_prefetch_ahead, as a one-group (decode) sweep. Measured "
         "on an AMD Zen 5 VM, t0 (next tile) against same (t2, 2 KiB ahead): fused MoE BF16 `small` at 128 "
         "tokens x1.10 / x1.08 / x1.01 in three runs, V3 at 64 tokens x1.04; FP8 and INT8 there x1.01 / x1.00",
         choices=("same", "t0", "t1", "t2", "none")),
    Knob("cpu_prefill_prefetch_ahead", int, 0, "kernels/cpu",
         "CPU microkernels, a sweep of more than one token group, unless cpu_prefill_prefetch_hint is same: "
         "bytes ahead in its own row each weight row is prefetched, as cpu_prefetch_ahead (0, or more than a "
         "row: the next tile's rows at the offset being read)",
         choices=(0, 64, 128, 256, 512, 1024, 2048, 4096)),
    Knob("cpu_bf16_expert_layout", str, "auto", "kernels/cpu",
         "CPU kernels, BF16 expert stacks (fused MoE), chosen at load: rows (the checkpoint's row-major "
         "layout) or r16 (each 16 rows interleaved by bf16 pair, repacked once in place: a tile reads one "
         "contiguous line per 16 rows per step and multiplies each token's pair broadcast into 16-row "
         "accumulators, no horizontal sums; every token count runs on it, except on AMX CPUs from "
         "cpu_amx_min_tokens, where AMX's GEMM reads the blocks in place as B tiles, grouped as cpu_moe_gemm_experts "
         "says). auto: r16 where the CPU has AMX (an AMX VM, `small` BF16 engine, r16 against rows: TPOT x1.00, "
         "TTFT x1.08 / x1.09 / x1.11 at 128 / 512 / 2048 tokens), or runs AVX512-BF16 or the AVX-512 build (float32 "
         "FMAs on the pair's halves without AVX512-BF16: on an Emerald Rapids VM, AVX512-BF16 and AMX hidden, "
         "x1.00 / x1.13 / x1.58 / x1.45 rows' speed at 1 / 16 / 128 / 512 tokens, `small`), else rows. A stack "
         "whose rows are not a multiple of 32 (gate|up: of 16 per half) or whose K is odd stays rows",
         choices=("auto", "rows", "r16"), tune=False),
    Knob("cpu_bf16_linear_layout", str, "auto", "kernels/cpu",
         "CPU kernels, BF16 linears, chosen at load: rows, or r16 (as cpu_bf16_expert_layout: repacked once in "
         "place: the r16 tiles, AMX's GEMM on the blocks from cpu_amx_min_tokens where AMX runs, and oneDNN on rows "
         "restored block by block from cpu_r16_onednn_min_tokens for bf16 activations); auto: as "
         "cpu_bf16_expert_layout's (Emerald Rapids VM, AVX512-BF16 hidden, [11264, 2048]: x1.01 at 1 token, "
         "x1.21 at 512 against rows' unpack + BLAS). A weight whose rows are not a multiple of 16 or whose K is "
         "odd stays rows. "
         "AMD Zen 5 VM, r16 against rows (oneDNN from cpu_gemm_min_tokens): [11264, 2048] x1.36 / x1.44 at 1 / 4 "
         "tokens, x1.04 at 128, x0.95 at 512; [32000, 2048] (lm_head) x1.16 at 1. Where AMX runs, auto is r16 "
         "(an AMX VM, [11264, 2048] from DRAM, one process alternating, since a single row block runs each column "
         "block in one prefetched stream: x1.07 / x1.24 / x1.08 / x1.83 / x1.15 rows' speed at 1 / 16 / 32 / 64 / "
         "512 tokens)",
         choices=("auto", "rows", "r16"), tune=False),
    Knob("cpu_int8_expert_layout", str, "auto", "kernels/cpu",
         "CPU kernels, INT8 expert stacks (fused MoE), chosen at load: rows (row-major, as the checkpoint) or r16 "
         "(each 16 rows interleaved by 4-byte unit, repacked once in place, as cpu_bf16_expert_layout's: a tile "
         "reads one contiguous line per 16 rows per step and multiplies each token's 4 activation bytes, broadcast, "
         "into 16-row int32 accumulators on vpdpbusd, or vpmaddubsw without VNNI; every token count on it except on "
         "AMX CPUs from cpu_amx_min_tokens, where AMX's GEMM reads the blocks in place as B tiles, grouped as "
         "cpu_moe_gemm_experts says; the same result bit for bit). auto: r16 where the CPU has AVX512-VNNI or AMX "
         "(an AMX VM, `small` INT8 engine, r16 against rows: TPOT x1.01, TTFT x1.05 at 512 and 2048 tokens; fused "
         "MoE x1.05 / x0.99 / x0.97 / x1.10 at 1 / 16 / 128 / 512 tokens), else rows. A stack whose rows are not a multiple of 32 or whose K is not a "
         "multiple of 4 stays rows",
         choices=("auto", "rows", "r16"), tune=False),
    Knob("cpu_int8_linear_layout", str, "auto", "kernels/cpu",
         "CPU kernels, INT8 linears, chosen at load: rows, or r16 (as cpu_int8_expert_layout; rows a multiple of "
         "16, K of 4); auto: r16 where the CPU has AVX512-VNNI or AMX (on an AMX VM, [11264, 2048] from DRAM, one "
         "process alternating: x1.08 / x1.58 / x1.70 / x1.49 / x1.07 rows' speed at 1 / 16 / 32 / 128 / 512 tokens)",
         choices=("auto", "rows", "r16"), tune=False),
    Knob("cpu_int4_expert_layout", str, "auto", "kernels/cpu",
         "CPU kernels, INT4 expert stacks of groups of 128 (fused MoE), chosen at load: rows, or r16 (each 16 rows' "
         "packed bytes interleaved by 4-byte unit, scales per block of 16 rows, repacked once in place: per unit one "
         "line per 16 rows, the nibbles against each token's int8 activations (the INT4 int8 method's), broadcast "
         "4 at a time, into 16-row int32 sums per group on vpdpbusd, or vpmaddubsw without VNNI; every token count "
         "on it, no GEMM path, whatever cpu_int4_method says). auto: r16 where the CPU has AVX512-VNNI. Other groups "
         "and stacks whose rows are not a multiple of 32 stay rows. AMD Zen 5 VM, `small`, r16 against rows: x1.11 "
         "(x1.2 with cpu_r16_rows 16) at T=1, x2.4 at 128 tokens, x1.35 at 512",
         choices=("auto", "rows", "r16"), tune=False),
    Knob("cpu_int4_linear_layout", str, "rows", "kernels/cpu",
         "CPU kernels, INT4 linears of groups of 128, chosen at load: rows, or r16 (as cpu_int4_expert_layout; rows "
         "a multiple of 16); auto: r16 where the CPU has AVX512-VNNI. Default rows: on an AMD Zen 5 VM r16 ran "
         "[11264, 2048] x0.97 / x1.07 (32 / 16 rows per tile) at 1 token and x0.88 at 512 against rows (the INT4 "
         "VNNI GEMM there)",
         choices=("auto", "rows", "r16"), tune=False),
    Knob("cpu_fp8_expert_layout", str, "auto", "kernels/cpu",
         "CPU kernels, FP8 E4M3 expert stacks (fused MoE), chosen at load: rows, or r16 (each 16 rows interleaved by "
         "4-byte unit of 4 fp8, repacked once in place: per unit one line per 16 rows turned into bf16 pairs in "
         "registers against each token's 4 activations broadcast, on vdpbf16ps for bf16 activations, else float32 "
         "FMAs on the exact values; the block scale per group; every token count on it, no GEMM path). auto: r16 "
         "where the CPU has no AMX and runs AVX512-BF16 or the AVX-512 build (without AVX512-BF16, on an Emerald "
         "Rapids VM: x1.00 / x1.02 / x1.64 / x1.38 rows' speed at 1 / 16 / 128 / 512 tokens, `small`), else "
         "rows. Scale blocks not of whole 16 rows, or rows not a "
         "multiple of 32 (16 for a linear), stay rows. r16 against rows, python -m suites.moe_ab (alternating): "
         "AMD Zen 4 VM, decode tiles of 64 rows (cpu_r16_fp8_rows), T=1: `small` x1.01-1.28, V3 x1.03-1.38 (rows "
         "run compute-bound at about 30 GB/s); 128 / 512 tokens x1.90 / x1.41. AMD Zen 5 VM (32 rows then): "
         "prefill x1.57 / x1.40, decode x0.84-0.86 `small`, x0.92 V3 (x0.93-0.99 / x1.01 with 64)",
         choices=("auto", "rows", "r16"), tune=False),
    Knob("cpu_fp8_linear_layout", str, "rows", "kernels/cpu",
         "CPU kernels, FP8 linears, chosen at load: rows, or r16 (as cpu_fp8_expert_layout); auto: as "
         "cpu_fp8_expert_layout's. Default rows: r16 has no GEMM path; AMD Zen 4 VM, [11264, 2048] r16 against "
         "rows x1.16 at T=1, x0.84 at 512 tokens (python -m suites.moe_ab --linear); Emerald Rapids VM without "
         "AVX512-BF16 x1.02 / x0.80",
         choices=("auto", "rows", "r16"), tune=False),
    Knob("cpu_r16_rows", int, 32, "kernels/cpu",
         "CPU linear and fused MoE on BF16 r16 weights (cpu_bf16_expert_layout and linear_layout; INT8, INT4 and "
         "FP8 have cpu_r16_int8_rows, _int4_rows, _fp8_rows), a sweep of one token group (decode): rows per "
         "register tile (16 per contiguous stream). AMD Zen 4 VM, fused MoE T=1, 16 / 32 / 64: `small` x1.01 / "
         "x1.00 / x1.00, V3 x1.01 / x1.00 / x0.96. AMD Zen 5 VM against "
         "row-major BF16 at T=1, 16 / 32 / 64: fused MoE `small` x1.13-1.17 / x1.07-1.11 / x1.03, linear "
         "[32000, 2048] x1.11 / x1.16 / x1.20, [11264, 2048] x1.13 / x1.36 (64: not measured)", choices=(16, 32, 64)),
    Knob("cpu_r16_int8_rows", int, 64, "kernels/cpu",
         "CPU linear and fused MoE on INT8 r16 weights, a sweep of one token group (decode): rows per register tile, "
         "as cpu_r16_rows for BF16 (each 16 rows one stream: more rows, more streams in flight per core). AMD Zen 4 "
         "VM, 64 against 32 rows (python -m suites.moe_ab, alternating, T=1): fused MoE `small` x1.06 / x1.06, V3 "
         "x1.06 / x1.06; linear [11264, 2048] x1.12, [32000, 2048] x1.01, [2048, 1408] x1.07", choices=(16, 32, 64)),
    Knob("cpu_r16_int4_rows", int, 16, "kernels/cpu",
         "CPU linear and fused MoE on INT4 r16 weights, a sweep of one token group (decode): rows per register tile, "
         "as cpu_r16_rows for the other formats. AMD Zen 4 VM, fused MoE at T=1 (python -m suites.moe_ab), 16 / 32 / "
         "64: `small` 0.96-1.10 / 1.11-1.30 / 1.20 ms (INT8 on 32: 1.64-1.75 ms), V3 7.35 / 7.54 ms; AMD Zen 5 VM "
         "(session 24): 16 x1.08 32 on `small`", choices=(16, 32, 64)),
    Knob("cpu_r16_fp8_rows", int, 64, "kernels/cpu",
         "CPU linear and fused MoE on FP8 r16 weights, a sweep of one token group (decode): rows per register tile, "
         "as cpu_r16_rows for the other formats (each 16 rows one stream; more rows, more streams in flight). AMD "
         "Zen 4 VM, fused MoE at T=1 (python -m suites.moe_ab, alternating), 32 / 64 rows: `small` x0.93 / x1.09 "
         "INT8's speed, V3 x0.91 / x1.10 (FP8 on rows: x0.85 / x0.80)", choices=(16, 32, 64)),
    Knob("cpu_r16_prefill_rows", int, 64, "kernels/cpu",
         "CPU linear and fused MoE on r16 weights, a sweep of several token groups (prefill): rows per register tile, "
         "each group of cpu_r16_tokens running over all of K on them (the first group's rows from memory, "
         "the later groups' from L2). `small` on an AMD Zen 5 VM against row-major BF16, 64 / 32 / 16: "
         "x1.40 / x1.35 / x1.06 at 128 tokens, x1.43 / x1.29 at 512", choices=(16, 32, 64)),
    Knob("cpu_r16_next_prefetch", str, "t1", "kernels/cpu",
         "CPU linear and fused MoE on r16 weights, a sweep of several token groups: the cache level into which a row "
         "tile's second group (its rows already cached by the first) prefetches the next tile's rows, so "
         "they stream from memory while it computes (the later groups prefetch nothing), or none (every "
         "group prefetches its own rows as the first does, cpu_prefill_prefetch_hint). `small` at 128 tokens "
         "on an AMD Zen 5 VM: t1 x1.02 none at 6 tokens per tile, none x1.03 t1 at 12. AMD Zen 4 VM, t1 against none "
         "(the later groups' tiles built without prefetch code): BF16 linear [11264, 2048] at 512 tokens x1.06-1.08 "
         "(x1.03 torch's oneDNN), fused MoE `small` BF16 x1.07 at 128 and 512 tokens, INT8 x0.99 / x1.11-1.13, "
         "INT4 x1.00",
         choices=("t0", "t1", "t2", "none")),
    Knob("cpu_r16_tile_blocks", str, "adjacent", "kernels/cpu",
         "CPU linear and fused MoE on r16 weights: the 16-row blocks of a register tile, adjacent (a sweep's tiles "
         "each start a new set of streams), or spread (tile j takes blocks j, j + S, ... with S = the sweep's blocks "
         "/ the tile's, so each stream runs on through S consecutive blocks), as cpu_tile_rows for row-major weights. "
         "AMD Zen 4 VM (python -m suites.moe_ab, spread against adjacent): fused MoE at T=1 INT8 `small` x1.03 / x1.03, "
         "V3 x0.99, BF16 x1.02, INT4 on 32 rows spread x1.01-1.03 the 16-row default; at 128 tokens BF16 x0.97, "
         "INT8 x1.01: hence adjacent by default",
         choices=("adjacent", "spread")),
    Knob("cpu_r16_tokens", int, 12, "kernels/cpu",
         "CPU linear and fused MoE on INT8, INT4 and FP8 r16 weights (BF16: cpu_r16_bf16_tokens): tokens per register "
         "tile (the rest of a sweep's tokens in one "
         "smaller tile); a tile holds at most 24 accumulators of 16 rows, so past 6 tokens it has fewer rows "
         "than cpu_r16_rows / cpu_r16_prefill_rows say. `small` on an AMD Zen 5 VM against row-major BF16, 12 / 8 / "
         "6 / 4 tokens: x1.16-1.23 / x1.16 / x1.08-1.11 / x1.00 at 128 tokens, 12 / 6: x1.33 / x1.31 at 512",
         low=1, high=12),
    Knob("cpu_r16_onednn_min_tokens", int, 4096, "kernels/cpu",
         "CPU linear on BF16 r16 weights (cpu_bf16_linear_layout) with bf16 activations: from this many tokens, "
         "torch's bf16 linear (oneDNN) on the weight's rows restored from r16, cpu_gemm_block_n rows at a time into "
         "one reused buffer, instead of the r16 tiles (4096: the tiles at every token count). AMD Zen 4 VM, linear "
         "[11264, 2048] at 512 tokens: 72.6-75.5 ms against 68.9 ms for 6-token tiles and 65.6 ms for oneDNN on "
         "row-major weights (cpu_gemm_block_n 2048 ahead of 256), hence off by default; the tuner may set it per shape",
         low=1, high=4096, log=True),
    Knob("cpu_r16_bf16_tokens", int, 6, "kernels/cpu",
         "CPU linear and fused MoE on BF16 r16 weights: tokens per register tile, as cpu_r16_tokens for the other r16 "
         "formats (each token's bf16 pair is broadcast once per step for the tile's blocks: 4 blocks x 6 tokens "
         "broadcast half as often as 2 x 12). AMD Zen 4 VM (AVX-512 on 256-bit units), 6 against 12: linear "
         "[11264, 2048] x1.39 at 512 tokens (68.9 against 95.8 ms), fused MoE `small` x1.07; Zen 5 (session 23, "
         "cpu_r16_tokens' figures): "
         "x0.98 at 512, x0.90-0.93 at 128",
         low=1, high=12),
    Knob("cpu_r16_bf16_one_group", int, 12, "kernels/cpu",
         "CPU fused MoE on BF16 r16 experts: an expert with at most this many tokens (a prefill's few per expert) "
         "runs them as one token group, each tile of at most 24 / tokens blocks reading its rows once, instead of "
         "groups of cpu_r16_bf16_tokens whose later ones read them again from cache; 0 (or at most "
         "cpu_r16_bf16_tokens): never. Linears keep cpu_r16_bf16_tokens. AMD Zen 4 VM, `small` at 128 tokens "
         "(about 12 per expert; python -m suites.moe_ab, alternating), 12 / 10 / 8 against 0: x1.05-1.06 / x1.03 / x1.00; "
         "the same as a linear's rule, [11264, 2048] / [32000, 2048] at 12 tokens: x0.93 / x0.91",
         low=0, high=12),
    Knob("cpu_gemm_block_n", int, 256, "kernels/cpu",
         "CPU GEMM path: weight rows unpacked per BLAS call (the unpack cache block)",
         low=16, high=4096, log=True, pow2=True),
    Knob("cpu_unpack_gemm", str, "auto", "kernels/cpu",
         "CPU GEMM path, after the weight rows are unpacked to float32 (the unpack variants of cpu_*_gemm): "
         "torch's float32 BLAS on each cpu_gemm_block_n block (blas), or our register-tile kernel (fma: 16 "
         "weight rows unpacked and packed into a K × 16 panel, then 6 tokens × 16 columns of float32 FMAs "
         "per tile, 12 accumulators in AVX2 registers); auto: fma in the AVX2 build of the kernels (MKL's "
         "sgemm ran at 38 % of the FMA peak on an AMD Zen 3 VM, docs/cpu_kernels.md), blas in the "
         "AVX-512 build", choices=("auto", "blas", "fma")),
    Knob("cpu_fp8_method", str, "widen", "kernels/cpu",
         "CPU FP8 weights: E4M3 expanded by bit arithmetic in 32-bit lanes (vector), by a 256-entry "
         "table gather (lut), or widened through 16-bit lanes to bfloat16 bits against activations "
         "permuted to match (widen; exact, half the instructions; block K a multiple of 64, else vector)",
         choices=("vector", "lut", "widen")),
    Knob("cpu_bf16_method", str, "auto", "kernels/cpu",
         "CPU BF16 weights on float32 FMAs (where no AVX512-BF16 dot product runs): each bf16 widened to "
         "its own float32 lane (widen), or the two bf16 of each 32-bit lane split by a shift and a mask "
         "against activations de-interleaved to match (split; half the load and conversion "
         "instructions), or split on 256-bit registers with tiles of at most 8 accumulators, for AVX2's 16 "
         "registers (split256; AVX2 instructions, runs on every CPU the kernels run on); auto: split256 in "
         "the AVX2 build of the kernels, split in the AVX-512 one", choices=("auto", "widen", "split", "split256")),
    Knob("cpu_k_block", int, 512, "kernels/cpu",
         "CPU register-tile kernels written for AVX2's 16 registers: K elements per pass, so that a pass's "
         "operands stay in L1. The BF16 split256 microkernel: where a tile's rows x tokens exceed its 8 "
         "accumulators (4 x 4, 8 x 2, 8 x 4), the tile's row groups take turns over blocks of K this long, each "
         "group's sums parked in memory between turns; the FMA tile GEMM (cpu_unpack_gemm=fma): each 6 x 16 "
         "tile's K in passes this long over its slice of x and of the weight panel, summed into the output",
         choices=(64, 128, 256, 512, 1024, 2048, 4096)),
    Knob("cpu_int4_method", str, "int8", "kernels/cpu",
         "CPU INT4 weights: integer products against activations quantized per token to int16 (int16; "
         "groups of a multiple of 64), byte products against activations quantized per token and group "
         "to int8 (int8, as llama.cpp's Q4 x Q8: half the instructions again, ~0.5 % activation error; "
         "groups of a multiple of 128, else int16), or float products (float)",
         choices=("float", "int16", "int8")),
    Knob("cpu_task_chunk", int, 1, "kernels/cpu",
         "CPU linear / fused MoE: consecutive parallel tasks a thread takes at once (1: fully dynamic; "
         "more: each thread streams longer runs of adjacent weight rows, which its software prefetch "
         "has already fetched)", low=1, high=64, log=True),
    Knob("cpu_amx_min_tokens", int, 8, "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert): from this many rows the AMX variant of the GEMM path "
         "(cpu_int8_gemm amx or auto, cpu_bf16_gemm amx, or auto on bf16 activations) runs where the CPU has "
         "AMX (inert elsewhere). Measured on an AMX VM, [11264, 2048]: AMX (weight rows in place) against "
         "VNNI's GEMM x1.4 (INT8, 16 tokens) to x2.6 (64), against vdpbf16ps / oneDNN x1.6 (BF16, 16) and x1.5 "
         "(64); fused MoE at 12-16 tokens per expert x1.2-1.6",
         low=1, high=4096, log=True),
    Knob("cpu_amx_direct_max_tokens", int, 64, "kernels/cpu",
         "CPU AMX GEMM: up to this many rows (tokens per expert in fused MoE) the weight rows are read as AMX "
         "tiles where they lie, each once from memory, and the activations are packed instead (no weight "
         "packing, which costs a pass over the weight for rows it barely serves); from more rows, 32-row "
         "weight blocks are packed once and serve every row block (0: always packed)", low=0, high=4096),
    Knob("cpu_amx_fp8_direct_max_tokens", int, 128, "kernels/cpu",
         "CPU AMX GEMM, FP8 weights (cpu_fp8_gemm amx or auto): up to this many rows (tokens per expert in fused MoE) "
         "each 32-row weight block is expanded to bf16 rows (value x block scale, rounded: the packed path's values) "
         "into a thread's buffer and read as A tiles against the packed activations, each block once per call; from "
         "more rows the packed nest (blocks expanded to bf16 as B tiles, a 16 x 16 transpose of bf16 pairs each; 0: "
         "always packed). Bitwise the same result. Measured on an AMX VM (Xeon, family 6 model 167 as KVM reports "
         "it, 2 threads; weights from DRAM), the expanded rows against the packed nest: [11264, 2048] x1.45 / x1.27 / "
         "x1.14 / x1.18 / x1.12 / x0.97 at 8 / 32 / 64 / 128 / 256 / 512 rows, [2048, 5632] x1.48 / x1.14 / x0.76 at "
         "64 / 128 / 512; fused MoE `small` x1.46 at 128 tokens, x1.11 at 512", low=0, high=4096),
    Knob("cpu_amx_n_group", int, 4, "kernels/cpu",
         "CPU AMX GEMM (packed or r16 weights, from cpu_amx_direct_max_tokens rows): 32-column weight blocks per "
         "parallel task; within each K pass (cpu_amx_k_block) every block of the group meets every 32-row block of "
         "the row chunk (cpu_amx_m_block), so a row block's K range serves the group from L2 while a column block's "
         "stays in L1 (fewer where the groups would leave a thread without one). Measured on an AMX VM (Xeon, "
         "family 6 model 167 as KVM reports it, 2 threads; suites.moe_ab --linear, weights from DRAM, rows layout), "
         "4 with cpu_amx_k_block / cpu_amx_m_block 512 against the one-block nest (1, 0, 0): [2048, 5632] at 512 "
         "tokens BF16 x1.24, INT8 x1.13; [11264, 2048] x1.02 at 512, x1.03 at 128 (8 there: x0.87-0.91, the group's "
         "packing bursts), BF16 x1.12 / INT8 x1.22 at 2048", low=1, high=64, log=True),
    Knob("cpu_amx_m_block", int, 512, "kernels/cpu",
         "CPU AMX GEMM: activation rows per chunk of the loop nest (a multiple of 32; 0: all rows in one): the "
         "partial sums of a column group (cpu_amx_n_group) wait for the next K pass in a buffer of 4 KiB per 32 "
         "rows per column block, and a chunk's A range stays in L2 (the AMX VM, [11264, 2048] at 2048 tokens, one weight "
         "warm in L3, groups of 8, K passes of 512: 64 / 128 / 256 rows x1.27 / x1.25 / x1.21 the one-block nest, BF16; "
         "INT8 x1.38 / x1.35 / x1.34)", choices=(0, 64, 128, 256, 512, 1024, 2048)),
    Knob("cpu_moe_gemm_experts", str, "grouped", "kernels/cpu",
         "CPU fused MoE, INT8, BF16 and FP8 experts on the GEMM path that AMX runs on the weights in place (row-major rows "
         "as A tiles, r16 blocks as B tiles, FP8 rows expanded to bf16 first; from cpu_amx_min_tokens to "
         "cpu_amx_direct_max_tokens tokens, FP8 cpu_amx_fp8_direct_max_tokens): all of them in one parallel region per phase "
         "(grouped: tasks of an expert's 32 gate and up rows with SiLU fused, then of 32 output columns over every "
         "such expert; no per-expert output tensors, SiLU pass or index_add_), or one GEMM call per expert with all "
         "threads (each); the call record's isa names grouped (+grouped) where it ran. Bitwise the same result where every GEMM-path expert is grouped (else the experts' sums "
         "meet a token in another order). Measured on an AMX VM (Xeon, family 6 model 167 as KVM reports it, 2 "
         "threads; suites.moe_ab, weights from DRAM), grouped against each: `small` INT8 x1.05 / x1.21 / x1.15 at 64 / "
         "128 / 512 tokens, BF16 x1.13 at 128, V3 INT8 x1.07 at 128; INT8 `small` TTFT x1.07 at 512 and 2048 tokens",
         choices=("grouped", "each")),
    Knob("cpu_amx_k_block", int, 512, "kernels/cpu",
         "CPU AMX GEMM: bytes of K per pass of every 32-row block of activations over one packed 32-column "
         "weight block, the block's K range staying in L1 for the pass (2 KiB per 64 bytes) while the "
         "partial sums wait in memory between passes (0: all of K in one pass, the sums kept in tiles). "
         "Measured on an AMX VM (Xeon, family 6 model 167 as KVM reports it), [11264, 2048] at 512 tokens: "
         "alone (one column block per task) 0 / 512 / 1024 within 5 % of each other, INT8 and BF16; with groups "
         "of 8 column blocks (cpu_amx_n_group), one weight warm in L3, 256 / 512 / 1024 x1.05 / x1.10 / x1.03 the "
         "one-block nest, BF16",
         choices=(0, 256, 512, 1024, 2048, 4096)),
    Knob("cpu_int8_isa", str, "auto", "kernels/cpu",
         "CPU INT8 weights and the INT4 int8 method, microkernels: the dot-product instruction; vnni: "
         "vpdpbusd (AVX512-VNNI) on activations + 128 (64 products per instruction, exact), avx512: "
         "INT8 on int16 vpmaddwd (INT4 on vpmaddubsw), maddubs: INT8 on vpmaddubsw + vpmaddwd with the "
         "sign trick, |w| times x negated where w < 0 (exact, any CPU the kernels run on; INT4 on vpmaddubsw as "
         "under avx512), auto: vnni "
         "where the CPU has it, else maddubs in the AVX2 build and avx512 in the AVX-512 one. vnni where "
         "the CPU lacks it falls back to avx512 at the call (the call record says which ran)",
         choices=("auto", "avx512", "vnni", "maddubs")),
    Knob("cpu_bf16_isa", str, "auto", "kernels/cpu",
         "CPU BF16 and FP8 weights, microkernels: the dot-product instruction; avx512bf16: vdpbf16ps "
         "(AVX512-BF16) on activations rounded to bf16 (FP8: expanded to bf16 in registers), avx512: "
         "float32 FMAs, auto: avx512bf16 where the CPU has it and the activations are bf16 already "
         "(then nothing is rounded that the model did not round). Falls back to avx512 where the CPU "
         "lacks it", choices=("auto", "avx512", "avx512bf16")),
    Knob("cpu_bf16_gemm", str, "auto", "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert) with BF16 weights on the GEMM path (from "
         "cpu_gemm_min_tokens rows): our weight unpack + float32 BLAS (unpack); torch's "
         "bf16 linear, i.e. oneDNN, on activations rounded to bf16 with a bf16 output (onednn); our tile "
         "GEMM on vdpbf16ps, activations rounded to bf16 (avx512bf16; needs AVX512-BF16, else unpack); our "
         "GEMM on AMX tiles (TDPBF16PS), activations rounded to bf16, from cpu_amx_min_tokens rows (amx; needs "
         "AMX, else unpack); auto, for activations that are bf16 already: amx where the CPU has AMX, onednn "
         "where it has AVX512-BF16, else unpack (float32 activations: unpack)",
         choices=("auto", "unpack", "onednn", "avx512bf16", "amx")),
    Knob("cpu_fp8_gemm", str, "auto", "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert) with FP8 weights on the GEMM path (from cpu_gemm_min_tokens "
         "rows): weight unpack to float32 + BLAS (unpack), or the weight dequantized to bf16 (each value × its "
         "block scale rounded to bf16, as DeepSeek's FP8 → BF16 cast) and torch's bf16 linear, i.e. oneDNN, on "
         "activations rounded to bf16 with a bf16 output (onednn), or our tile GEMM on vdpbf16ps over the same "
         "bf16 values, expanded per 32-row block as it is packed (avx512bf16; needs AVX512-BF16, else unpack), or "
         "the same values on AMX tiles from cpu_amx_min_tokens rows (amx; needs AMX, else unpack: each 32-row block "
         "expanded to bf16 rows as A tiles up to cpu_amx_fp8_direct_max_tokens rows, else packed as B tiles; measured "
         "on an AMX VM: linear [11264, 2048] / [32000, 2048] x1.72-1.83 onednn at 128 tokens, x1.49-1.56 at 512); "
         "auto, for activations that are bf16 already: amx where the CPU has AMX (avx512bf16 below "
         "cpu_amx_min_tokens), avx512bf16 where it has AVX512-BF16, else unpack (float32 activations: unpack). "
         "FP8 takes the GEMM path from cpu_gemm_min_tokens rows, or from cpu_amx_min_tokens where AMX runs it (fused "
         "MoE `small` at 128 / 512 tokens on an AMX VM: the microkernels x0.47 / x0.18 of AMX's expanded rows)",
         choices=("auto", "unpack", "onednn", "avx512bf16", "amx")),
    Knob("cpu_int8_gemm", str, "auto", "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert) with INT8 weights on the GEMM path (from "
         "cpu_gemm_min_tokens rows): weight unpack + float32 BLAS (unpack), our tile GEMM on vpdpbusd "
         "(vnni; exact integer sums; needs AVX512-VNNI, else unpack), on AVX2's vpmaddubsw with the sign trick "
         "(maddubs; exact; runs on every CPU the kernels run on), or on AMX tiles (amx: TDPBSSD, exact, from "
         "cpu_amx_min_tokens rows; needs AMX, else unpack), each from the quantized integers. auto: amx where "
         "the CPU has AMX (from cpu_amx_min_tokens rows), vnni where it has AVX512-VNNI (1.9-3.0x unpack at 512 "
         "tokens where measured), maddubs in the AVX2 build of the kernels, else unpack",
         choices=("auto", "unpack", "vnni", "maddubs", "amx")),
    Knob("cpu_int4_gemm", str, "auto", "kernels/cpu",
         "CPU linear / fused MoE (tokens per expert) with INT4 weights on the GEMM path (from "
         "cpu_gemm_min_tokens rows): weight unpack to float32 + BLAS on float activations (unpack), or our "
         "GEMM on vpdpbusd, nibbles × activations quantized to int8 per (token, scale group) as the int8 "
         "INT4 method (vnni; ~0.6 % activation error on random rows; needs AVX512-VNNI, else unpack), or "
         "the same GEMM on AVX2's vpmaddubsw, eight units summed in int16 between widenings (maddubs; runs on "
         "every CPU the kernels run on; the same sums, bitwise equal to vnni), or the same sums on AMX's TDPBSSD "
         "tiles, a K pass per scale group (amx; groups of a multiple of 64, from cpu_amx_min_tokens rows; bitwise "
         "equal to vnni; elsewhere as vnni). auto: amx where the CPU has AMX (groups of a multiple of 64, from "
         "cpu_amx_min_tokens rows), vnni where it has AVX512-VNNI, maddubs in the AVX2 build of the kernels, else "
         "unpack. INT4 r16 weights (cpu_int4_*_layout) have no GEMM path but AMX: amx runs them there from "
         "cpu_amx_min_tokens rows, auto from cpu_int4_r16_amx_min_tokens (each r16 line's nibbles are rows of B "
         "tiles; bitwise the r16 microkernels' result), the other values keep them on the microkernels (an AMX VM, "
         "fused MoE `small`, amx against them: x0.80 at 128 tokens, x1.24 at 512; an r16 linear [11264, 2048] "
         "x2.39 / x2.13 at 64 / 512)",
         choices=("auto", "unpack", "vnni", "maddubs", "amx")),
    Knob("cpu_int4_r16_amx_min_tokens", int, 32, "kernels/cpu",
         "CPU INT4 weights in the r16 layout, cpu_int4_gemm auto, where the CPU has AMX: from this many rows (tokens "
         "per expert in fused MoE; at least cpu_amx_min_tokens) AMX's GEMM over the r16 lines (gemm_int4_r16) runs "
         "instead of the r16 microkernels; the same result bit for bit. Measured on an AMX VM (Xeon, family 6 model "
         "167 as KVM reports it, 2 threads; suites.moe_ab, weights from DRAM), AMX against the microkernels: fused MoE "
         "`small` x0.93 / x1.23 / x1.28 at 256 / 512 / 1024 tokens (24 / 48 / 96 per expert); an r16 linear [11264, "
         "2048] x1.27 / x1.28 / x1.41 at 16 / 32 / 64 rows (INT4 linears take the row-major layout by default, "
         "whose GEMM runs on AMX from cpu_amx_min_tokens)", low=1, high=4096, log=True),
    Knob("cpu_huge_pages", bool, True, "kernels/cpu",
         "CPU kernels: each weight of ≥ 2 MiB in 2 MiB-aligned memory advised for transparent huge pages "
         "(the loader places it there; a weight prepared from elsewhere is copied once), and an INT4 weight's "
         "scales of ≥ 2 MiB (copied at prepare): fewer TLB misses while streaming experts from DRAM. Whole decode step on an Emerald Rapids VM x1.02-1.12 (INT8, "
         "BF16), fused MoE on an AMD Zen 4 VM x0.98-1.04 (docs/cpu_kernels.md)",
         choices=(False, True), tune=False),
    Knob("cpu_attn_head_fold", int, 128, "kernels/cpu",
         "CPU attention decode: most query heads sharing a KV head folded into one task's rows (each cache "
         "block converted once for them; register groups of ≤ 16, or sgemm from cpu_attn_blas_rows); with "
         "fewer (sequence, KV head, head block) tasks than threads the blocks are halved first, down to 16 "
         "heads, before any key split (MLA V3, Zen 4, one sequence x 512 keys: x1.72 -> x2.08 the reference)",
         low=1, high=256, log=True),
    Knob("cpu_attn_kv_splits", int, 8, "kernels/cpu",
         "CPU attention decode (flash decoding): most pieces one sequence's keys are cut into, computed "
         "in parallel and merged by log-sum-exp; never more than the threads need beside the batch's "
         "(sequence, KV head, head block) tasks (MLA V3, Zen 4: 128 heads x 512 keys at batch 16 x1.52 -> "
         "x2.39 the reference)", low=1, high=64, log=True),
    Knob("cpu_attn_decode_kv_block", int, 64, "kernels/cpu",
         "CPU attention decode: keys per cache block (converted and transposed once, used for the QK "
         "and the PV products while L2-resident)", low=16, high=1024, log=True, pow2=True),
    Knob("cpu_attn_isa", str, "auto", "kernels/cpu",
         "CPU attention (decode and extend) over a bf16 cache: the QK and PV products' instruction; "
         "avx512bf16: vdpbf16ps on bf16 pairs (queries rounded to bf16, the probabilities rounded to bf16 "
         "before PV; any row count, in place of the sgemm form), avx512: float32 FMAs (register tiles, or "
         "sgemm from cpu_attn_blas_rows), amx: AMX tiles (TDPBF16PS; the same roundings as avx512bf16, key "
         "and value dims multiples of 32 and 16, else avx512bf16's rule), auto: amx, else avx512bf16, where "
         "the CPU has it and every query value is a bf16 already. Falls back to avx512 where the CPU lacks "
         "it", choices=("auto", "avx512", "avx512bf16", "amx")),
    Knob("cpu_attn_f32_form", str, "auto", "kernels/cpu",
         "CPU attention on float32 FMAs (cpu_attn_isa avx512, or a CPU without AVX512-BF16), the register form (fewer "
         "rows per task than cpu_attn_blas_rows: up to 16 heads per KV head, or MLA's heads split into register "
         "groups): transpose (each key block converted to float32 and transposed, 16 keys in the lanes, the rows' "
         "queries broadcast; the probabilities transposed back for PV) or lanes (16 rows in the lanes, each key's "
         "float32 row broadcast: nothing transposed, the online softmax down the keys, PV on the same float32 rows), "
         "packed (GQA/MHA decode with at most 8 rows per KV head: the lanes form over 2 or 4 KV heads at once, their "
         "rows interleaved in the lanes and their key elements broadcast together; elsewhere as auto), "
         "auto: packed where it applies, else lanes for tasks of at least 16 rows, else transpose. Emerald Rapids "
         "VM, 2 threads, lanes against transpose: MLA decode `small` (16 heads) x1.12 / x1.20 / x1.30 at 140 / 512 "
         "/ 2048 keys; GQA decode, head dim 128, 2048 keys: 16 rows per KV head x1.25, 8 x0.99-1.05, 4 x0.91; "
         "packed against transpose (cache from DRAM, cpu_attn_prefetch t1 against none): 32 / 4 heads x1.24-1.32, "
         "32 / 8 (head dim 64) x1.31, MHA 16 / 16 x1.06",
         choices=("auto", "lanes", "transpose", "packed")),
    Knob("cpu_attn_prefetch", str, "auto", "kernels/cpu",
         "CPU attention decode on float32 FMAs (the register forms of cpu_attn_f32_form: packed, lanes, transpose): "
         "the cache level the software prefetch of the next cache block's key and value rows fills while this "
         "block's are used (prefetcht0 / t1 / t2, or none: the hardware prefetchers alone). Each line is prefetched "
         "beside the work on the same line of this block (the key conversion, the PV product), so the prefetches "
         "spread over the block; auto: t1 where K and V are rows of their own (GQA/MHA), none for MLA's latent "
         "(V the leading columns of K). Emerald Rapids VM, 2 threads, the cache from DRAM, t1 against none: GQA "
         "x1.06-1.17, MHA 16 / 16 x1.09, 64 / 4 heads (lanes) x1.30; MLA `small` x0.98-1.01",
         choices=("t0", "t1", "t2", "none", "auto")),
    Knob("cpu_attn_extend_q_block", int, 128, "kernels/cpu",
         "CPU extend attention (prefill): query rows per task", low=8, high=256, log=True, pow2=True),
    Knob("cpu_attn_extend_kv_block", int, 512, "kernels/cpu",
         "CPU extend attention (prefill): keys per online-softmax step", low=16, high=1024, log=True,
         pow2=True),
    Knob("cpu_attn_blas_rows", int, 32, "kernels/cpu",
         "CPU attention: from this many rows per task (folded heads, or a query tile) the QK and PV products "
         "run as sgemm on float32-converted cache blocks instead of the register kernels", low=1, high=1024,
         log=True),
    Knob("cpu_attn_blas_kv_block", int, 256, "kernels/cpu",
         "CPU attention decode, sgemm form (rows ≥ cpu_attn_blas_rows) and AMX form (cpu_attn_isa): keys "
         "per converted cache block",
         low=16, high=4096, log=True, pow2=True),
    Knob("cpu_serial_below_bytes", int, 65536, "kernels/cpu",
         "CPU decode-layer runner (graph_mode=cpp): an op reading fewer bytes than this (weights, or the "
         "layer's KV cache for attention) runs on the calling thread instead of opening an OpenMP parallel "
         "region whose fork/join costs more than the work (0: every op parallel)", low=0, high=1 << 24),
)

# read once at load (by prepare(), by the decode runner), not per call
LOAD_KNOBS = ("cpu_huge_pages", "cpu_serial_below_bytes", "cpu_bf16_expert_layout", "cpu_bf16_linear_layout",
              "cpu_int8_expert_layout", "cpu_int8_linear_layout", "cpu_int4_expert_layout", "cpu_int4_linear_layout",
              "cpu_fp8_expert_layout", "cpu_fp8_linear_layout")
# read per call: the fields of the C++ struct Knobs (kernels/cpu/csrc/common.h), named without "cpu_"
PER_CALL_KNOBS = tuple(k.name for k in CPU_KNOBS if k.name not in LOAD_KNOBS)
# the instruction-variant knobs (resolved at the call against the CPU's features): each variant → the
# CPU feature it needs (/proc/cpuinfo's flag name; None: any CPU the kernels run on, the "avx512" variants
# being the base paths of either build, kernels/cpu_build.py: AVX-512, or its C++ model on AVX2)
# (cpu_bf16_gemm's and cpu_fp8_gemm's onednn runs anywhere: oneDNN dispatches its own instructions,
# outside the mask)
ISA_VARIANTS = {"cpu_int8_isa": {"avx512": None, "vnni": "avx512_vnni", "maddubs": None},
                "cpu_bf16_isa": {"avx512": None, "avx512bf16": "avx512_bf16"},
                "cpu_bf16_gemm": {"unpack": None, "onednn": None, "avx512bf16": "avx512_bf16", "amx": "amx"},
                "cpu_fp8_gemm": {"unpack": None, "onednn": None, "avx512bf16": "avx512_bf16", "amx": "amx"},
                "cpu_int8_gemm": {"unpack": None, "vnni": "avx512_vnni", "maddubs": None, "amx": "amx"},
                "cpu_int4_gemm": {"unpack": None, "vnni": "avx512_vnni", "maddubs": None, "amx": "amx"},
                "cpu_attn_isa": {"avx512": None, "avx512bf16": "avx512_bf16", "amx": "amx"}}
ISA_KNOBS = tuple(ISA_VARIANTS)
# the features whose instructions have a C++ model in the kernels (their variants are tested everywhere);
# "amx": AMX-TILE with AMX-INT8 and AMX-BF16 (/proc/cpuinfo's amx_tile, amx_int8, amx_bf16)
MODELLED_FEATURES = ("avx512_vnni", "avx512_bf16", "amx")
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")


def variants_for(flags, build: str | None = "avx512") -> dict[str, dict[str, str]]:
    """Per ISA knob, each variant → "native" (the CPU flags have its feature, and the kernels' build runs
    AVX-512) or "model" (only the C++ model of its instructions runs here: tests). The AVX2 build runs
    every featured variant on its model. (Linux must also grant AMX's tile state; kernels.cpu's
    isa_variants() asks the kernels.)"""
    flags = set(flags) | ({"amx"} if all(f in flags for f in AMX_FLAGS) else set())
    return {knob: {v: "native" if need is None or (need in flags and build == "avx512") else "model"
                   for v, need in variants.items()} for knob, variants in ISA_VARIANTS.items()}
# read by the attention kernels (the others by linear / fused MoE)
ATTN_KNOBS = tuple(k.name for k in CPU_KNOBS if k.name.startswith("cpu_attn_"))

# Which per-call knobs each op of the backend reads: the kernel tier searches these per op, and the
# engine's per-shape tables (engine/kernel_tables.py) set and show these per call site.
_WEIGHT_OP_KNOBS = tuple(k.name for k in CPU_KNOBS if not k.name.startswith("cpu_attn_") and k.name not in LOAD_KNOBS)
OP_KNOBS: dict[str, tuple[str, ...]] = {
    "linear": tuple(n for n in _WEIGHT_OP_KNOBS if n != "cpu_moe_block_n"),
    "fused_moe": tuple(n for n in _WEIGHT_OP_KNOBS if n != "cpu_linear_block_n"),
    "mla_decode": ("cpu_attn_head_fold", "cpu_attn_kv_splits", "cpu_attn_decode_kv_block", "cpu_attn_blas_rows",
                   "cpu_attn_blas_kv_block", "cpu_attn_isa", "cpu_attn_f32_form", "cpu_attn_prefetch"),
    "extend_attention": ("cpu_attn_extend_q_block", "cpu_attn_extend_kv_block", "cpu_attn_blas_rows", "cpu_attn_isa",
                         "cpu_attn_f32_form"),
}
# The MHA/GQA paged attention runs the same C++ cores (decode, extend), so reads the same knobs.
OP_KNOBS["paged_decode"] = OP_KNOBS["mla_decode"]
OP_KNOBS["paged_extend"] = OP_KNOBS["extend_attention"]
