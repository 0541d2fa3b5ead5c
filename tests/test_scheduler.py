"""The continuous-batching scheduler on the "tiny" preset: admission by free blocks and by the
running cap, chunked prefill, decode batch cap, mixed steps, preemption + recompute, cancellation,
and batch invariance of the `batch_invariant` mode (bitwise, float32).
"""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm import RequestOutput
from engine.scheduler import Request, Scheduler, Status

VOCAB = 512


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_llm(**knobs) -> LLM:
    return LLM("tiny", dtype="float32", knobs=knobs, progress=False)


@pytest.fixture(scope="module")
def inv() -> LLM:
    """Batch-invariant, 8 blocks of 16 tokens (128 tokens of KV cache)."""
    return make_llm(batch_invariant=True, max_total_tokens=128, kv_block_size=16)


def request(prompt: list[int], n: int = 8) -> Request:
    return Request(RequestOutput(list(prompt)), SamplingParams(max_tokens=n, ignore_eos=True))


def drive(sched: Scheduler, max_steps: int = 500) -> int:
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def alone(llm: LLM, prompt: list[int], n: int = 8) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def all_free(llm: LLM) -> bool:
    return llm.cache.allocator.num_free == llm.cache.allocator.num_blocks


# ---------------------------------------------------------------- admission


def test_admission_waits_for_free_blocks(inv):
    sched = Scheduler(inv)
    reqs = [request(ids(40, s)) for s in range(3)]  # 3 blocks of prompt each; 8 blocks in all
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [r for r, _ in plan] == reqs[:2]  # the third's prompt would not fit beside them
    assert reqs[2].status is Status.WAITING and list(sched.waiting) == [reqs[2]]
    sched.cancel_all()
    assert all_free(inv)


def test_admission_respects_max_running_requests():
    llm = make_llm(max_running_requests=2)
    sched = Scheduler(llm)
    reqs = [request(ids(5, s), n=3) for s in range(3)]
    for r in reqs:
        sched.add(r)
    sched.step()
    assert sched.running == reqs[:2] and list(sched.waiting) == reqs[2:]
    drive(sched)
    assert all(len(r.out.token_ids) == 3 for r in reqs) and all_free(llm)


# ---------------------------------------------------------------- chunking and mixed steps


def test_chunked_prefill_splits_and_matches_unchunked():
    llm = make_llm(batch_invariant=True, chunked_prefill_size=16)
    prompt = ids(40, 7)
    sched = Scheduler(llm)
    r = request(prompt, n=6)
    sched.add(r)
    chunks = []
    while not r.out.token_ids:
        plan = sched.schedule()
        chunks.append(plan[0][1])
        sched.run(plan)
    drive(sched)
    assert chunks == [16, 16, 8]
    assert r.out.token_ids == alone(make_llm(batch_invariant=True), prompt, 6)
    assert all_free(llm)


def test_step_mixes_decodes_with_a_prefill_chunk():
    llm = make_llm(chunked_prefill_size=16)
    sched = Scheduler(llm)
    a, b = request(ids(5, 1), n=10), request(ids(40, 2), n=4)
    sched.add(a)
    sched.step()  # a: whole prompt, first token
    sched.add(b)
    plan = sched.schedule()
    assert [(r, n) for r, n in plan] == [(a, 1), (b, 16)]
    sched.cancel_all()
    assert all_free(llm)


def test_decode_batch_cap_rotates_fairly():
    llm = make_llm(decode_batch_cap=2)
    sched = Scheduler(llm)
    reqs = [request(ids(4, s), n=6) for s in range(3)]
    for r in reqs:
        sched.add(r)
    sched.step()  # three prefills, one token each
    decoded = []
    for _ in range(3):
        plan = sched.schedule()
        assert len(plan) == 2 and all(n == 1 for _, n in plan)
        decoded += [r.id for r, _ in plan]
        sched.run(plan)
    assert {decoded.count(r.id) for r in reqs} == {2}  # each twice in three capped steps
    drive(sched)
    assert all(len(r.out.token_ids) == 6 for r in reqs) and all_free(llm)


# ---------------------------------------------------------------- preemption and cancellation


def test_preemption_recomputes_to_identical_greedy_output(inv):
    """Two requests fit alone but not together: the newer is preempted, recomputed, and both
    give exactly their outputs alone; every block comes back."""
    a, b = ids(40, 11), ids(40, 12)  # 40 + 30 = 70 tokens each, 5 blocks; 8 blocks in all
    want = [alone(inv, a, 30), alone(inv, b, 30)]
    sched = Scheduler(inv)
    ra, rb = request(a, 30), request(b, 30)
    sched.add(ra)
    sched.add(rb)
    drive(sched)
    assert sched.num_preemptions >= 1 and rb.num_preemptions >= 1 and ra.num_preemptions == 0
    assert [ra.out.token_ids, rb.out.token_ids] == want
    assert all_free(inv)


def test_generate_survives_cache_pressure(inv):
    prompts = [ids(40, 20 + s) for s in range(4)]
    outs = inv.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == [alone(inv, p, 30) for p in prompts]
    assert all_free(inv)


def test_cancel_frees_blocks_at_once_and_others_continue(inv):
    sched = Scheduler(inv)
    keep, drop = request(ids(20, 31), 10), request(ids(50, 32), 10)
    sched.add(keep)
    sched.add(drop)
    for _ in range(3):
        sched.step()
    held = len(drop.seq.block_table)
    free_before = inv.cache.allocator.num_free
    assert held > 0
    sched.cancel(drop)
    assert inv.cache.allocator.num_free == free_before + held
    assert drop.status is Status.FINISHED and drop.out.finish_reason == "cancelled"
    drive(sched)
    assert keep.out.token_ids == alone(inv, ids(20, 31), 10)
    assert all_free(inv)


def test_cancel_waiting_request(inv):
    sched = Scheduler(inv)
    r = request(ids(8, 40))
    sched.add(r)
    sched.cancel(r)
    assert not sched.has_work() and r.status is Status.FINISHED


# ---------------------------------------------------------------- batch invariance


def test_batch_invariant_logits_are_bitwise_equal(inv):
    """One sequence's logits alone and inside a mixed step (another prompt's chunk, another
    sequence's decode) are bitwise equal in batch_invariant mode."""
    x, y, z = ids(12, 50), ids(30, 51), ids(9, 52)

    def last_logits(batch_mates: bool) -> torch.Tensor:
        rx, ry, rz = request(x), request(y), request(z)
        try:
            if batch_mates:
                inv._step([rz], [z])  # rz then decodes beside x's prefill
                out = inv._step([rz, rx, ry], [[z[0]], x, y[:17]])
                return out[1]
            return inv._step([rx], [x])[0]
        finally:
            for r in (rx, ry, rz):
                inv.cache.release(r.seq)

    assert torch.equal(last_logits(False), last_logits(True))
    assert all_free(inv)


# ---------------------------------------------------------------- the step's tensors


def test_step_tensors_equal_the_per_token_construction(inv):
    """LLM._batch builds positions, slots, block tables and the attention rows per sequence
    (no Python loop over tokens): they equal the token-by-token construction."""
    from engine.cache import SeqCache

    cache = inv.cache
    seqs = [SeqCache() for _ in range(4)]
    for s, n in zip(seqs, [0, 17, 5, 31]):  # already cached tokens
        cache.reserve(s, n)
    new = [ids(9, 60), [7], ids(20, 61), [8]]  # a fresh prompt, a decode, a chunk, a decode
    starts = [s.num_tokens for s in seqs]
    try:
        batch = inv._batch(seqs, new)
        bs = cache.block_size
        want_pos = [p for st, t in zip(starts, new) for p in range(st, st + len(t))]
        want_slots = [s.block_table[p // bs] * bs + p % bs
                      for s, st, t in zip(seqs, starts, new) for p in range(st, st + len(t))]
        assert batch.token_ids.tolist() == [t for toks in new for t in toks]
        assert batch.positions.tolist() == want_pos and batch.slots.tolist() == want_slots
        tables, lens = batch.decode_rows(torch.device("cpu"))
        rows = [(b, s.num_tokens - n + j + 1) for b, (s, n) in enumerate(zip(seqs, map(len, new))) for j in range(n)]
        assert torch.equal(tables, cache.block_tables(seqs)[[b for b, _ in rows]])
        assert lens.tolist() == [n for _, n in rows] and lens.dtype == torch.int32
        assert batch.last_token_index().tolist() == [8, 9, 29, 30]
    finally:
        for s in seqs:
            cache.release(s)
    assert all_free(inv)
