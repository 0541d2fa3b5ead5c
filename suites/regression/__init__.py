"""Kernel regression suite (pytest-benchmark): the cpu kernels timed on fixed cases, saved per run and
compared against an earlier run of the same machine.

    python -m pytest suites/regression --benchmark-save=before          # .benchmarks/<machine>/0001_before.json
    python -m pytest suites/regression --benchmark-compare=0001 --benchmark-compare-fail=median:10%
    python -m pytest suites/regression -k "fused_moe and int8" --benchmark-compare   # a subset, vs the latest save
    python -m pytest suites/regression --regression-shapes tiny --benchmark-disable  # each case once: checks only

What it is for: "did this commit make a kernel slower on this machine?", one change against the last
saved run, with pytest-benchmark's statistics (min / median / IQR over the rounds) and its compare
table. It complements the suites that report figures (suites/kernels.py: fractions of the probe's
limits and ratios to torch in alternation; suites/baselines: peers): a regression run times ours only,
so its two runs are minutes apart, and on a machine whose speed drifts (docs/baselines.md) a compare
needs a threshold above that drift.

Cases (suites/regression/test_cpu_kernels.py): linear and fused MoE for each weight format at 1, 16 and
128 tokens on the `small` preset's shapes (expert [2816, 2048] + [2048, 1408], 64 experts, top-6), and
MLA decode at 1 × 512 and 4 × 4096 keys. Before a case is timed its output is checked against
kernels.reference (the conformance tests' bounds), so a fast wrong kernel fails instead of "improving".
As in suites/kernels.py, few-token cases cycle through weight copies or routings so that the weights come
from DRAM as in decode. Every saved run records the machine's fingerprint (CPU, ISA, the kernels'
variants, commit) in its machine_info, and each case its ISA variant, bytes and FLOPs in extra_info.
`--regression-shapes tiny` runs the same cases on toy shapes (the CI smoke test of this suite).
"""
