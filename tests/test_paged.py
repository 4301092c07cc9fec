"""Lesson 13: the block manager on its own, and the paged cache against the contiguous one (single prompts on
the real model and the library; a batch, prefix hits, preemption and recompute on the tiny random model of
conftest, since paging must keep the tokens of any model): same tokens everywhere, no block leaked."""
import random

import pytest
import torch

from course_lib.runner import paged
from course_lib.engine.paged_scheduler import REJECTED, PagedScheduler
from course_lib.engine.request import end_of_turn_ids, Job
from course_lib.engine.generation import generate, run_paged, step
from course_lib.text.context import HANDBOOK_QUESTIONS, chat_ids, handbook_ids
from course_lib.runner.model import Model
from course_lib.runner.blocks import BlockManager, OutOfBlocks, Sequence
from course_lib.runner.paged import BlockPool

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about rain."]


@pytest.fixture(scope="module")
def ours(model):
    return Model.from_transformers(model)


@pytest.fixture(scope="module")
def small(tiny):
    """The course's model written out on the tiny random weights."""
    return Model.from_transformers(tiny)


@pytest.fixture(scope="module")
def stop(model, tokenizer):
    return frozenset(end_of_turn_ids(model, tokenizer))


@pytest.fixture(scope="module")
def alone(tokenizer, stop):
    """alone(m, prompt): greedy tokens of the prompt run alone on lesson 11's contiguous cache, 32 at most."""
    cache = {}

    def run(m, prompt):
        key = (id(m), tuple(prompt))
        if key not in cache:
            cache[key] = generate(m, tokenizer, prompt, max_new_tokens=32, stop_ids=stop).token_ids
        return cache[key]
    return run


# ----- the block manager alone -----

def test_blocks_are_counted_and_returned():
    m = BlockManager(4, block_size=2)
    a, b = m.allocate(), m.allocate()
    assert m.num_used == 2 and m.ref[a] == 1
    m.acquire(a)
    m.release(a)
    assert m.ref[a] == 1 and m.num_free == 2
    m.release(a), m.release(b)
    assert m.num_used == 0
    with pytest.raises(ValueError, match="released twice"):
        m.release(a)
    m.check()


def test_out_of_blocks_is_a_clear_error():
    m = BlockManager(1)
    m.allocate()
    with pytest.raises(OutOfBlocks, match="all 1 blocks"):
        m.allocate()


@pytest.mark.parametrize("blocks, size", [(0, 16), (-1, 16), (4, 0), (2.5, 16), (True, 16), (4, "16")])
def test_bad_pool_sizes_are_refused(blocks, size):
    with pytest.raises(ValueError, match="whole number"):
        BlockManager(blocks, size)


def test_names_are_chained_over_the_whole_prefix():
    same_block = [7, 8]
    assert paged.block_hash(None, same_block) != paged.block_hash(paged.block_hash(None, [1, 2]), same_block)
    assert paged.prefix_hashes([1, 2, 3, 4, 5], 2) == paged.prefix_hashes([1, 2, 3, 4, 9], 2)  # the partial block has no name
    assert paged.prefix_hashes([1, 2, 3, 4], 2)[0] != paged.prefix_hashes([1, 3, 3, 4], 2)[0]
    assert paged.blocks_for(33, 16) == 3 and paged.blocks_for(32, 16) == 2


def test_unused_cached_blocks_go_least_recently_used_first():
    m = BlockManager(3, block_size=1)
    a, b, c = m.allocate(), m.allocate(), m.allocate()
    m.register(a, b"A"), m.register(b, b"B")
    m.release(a), m.release(b), m.release(c)  # c holds nothing reusable: it is handed out first
    assert m.allocate() == c
    assert m.allocate() == a and m.match([b"A"]) == [] and m.evicted == 1  # a was the older: forgotten
    assert m.match([b"B"]) == [b]


def test_random_traces_keep_the_invariants():
    rng = random.Random(0)
    m, held = BlockManager(8, block_size=1), []
    for i in range(2000):
        op = rng.random()
        if op < 0.4 and m.num_free:
            held.append(m.allocate())
            if rng.random() < 0.5:
                m.register(held[-1], bytes([i % 256, i // 256]))
        elif op < 0.6 and held:
            block = rng.choice(held)
            m.acquire(block)
            held.append(block)
        elif held:
            m.release(held.pop(rng.randrange(len(held))))
        m.check()
        assert sorted(b for b, r in enumerate(m.ref) for _ in range(r)) == sorted(held)


# ----- the pool -----

def test_a_prefix_hit_reuses_full_blocks_only_and_always_computes_the_last_token(ours):
    pool = BlockPool.for_model(ours, 8, block_size=4)
    first = Sequence(list(range(10)))
    assert pool.admit(first) == 0
    pool.grow(first, 10)
    pool.commit(first, 10)  # as if prefilled: blocks 0 and 1 are full and named
    twin = Sequence(list(range(10)))
    assert pool.admit(twin) == 8 and twin.blocks == first.blocks[:2]
    exact = Sequence(list(range(8)))  # all its blocks are cached, but its last token must still run
    assert pool.admit(exact) == 4
    assert pool.manager.ref[first.blocks[0]] == 3 and pool.manager.ref[first.blocks[1]] == 2
    for s in (first, twin, exact):
        pool.free(s)
    assert pool.manager.num_used == 0 and len(pool.manager.by_hash) == 2  # kept for the next prompt
    pool.manager.check()


def test_bytes_per_block_follow_the_formula(ours):
    pool = BlockPool.for_model(ours, 10)
    assert pool.block_bytes == 2 * 30 * 16 * 3 * 64 * 4  # keys and values, layers, tokens, KV heads, D, float32
    assert pool.nbytes() == 10 * pool.block_bytes


def test_several_rows_decode_one_token_each(ours):
    pool = BlockPool.for_model(ours, 8)
    seqs = [Sequence([1, 2, 3]), Sequence([4, 5])]
    for s in seqs:
        pool.admit(s)
        pool.grow(s, 3)
    view = pool.view(seqs)
    with pytest.raises(ValueError, match="prefill each prompt alone"):
        view.reserve(3)
    with pytest.raises(OutOfBlocks, match="call pool.grow"):
        pool.view([Sequence([1] * 20)]).reserve(20)


# ----- the paged cache on the real model -----

def test_alone_paged_equals_contiguous_and_the_library(model, ours, tokenizer, stop, alone):
    for q in QUESTIONS[:2]:
        prompt = chat_ids(tokenizer, q)
        job = Job("a", prompt, 32, stop)
        pool = BlockPool.for_model(ours, 16)
        run_paged(ours, [job], pool)
        library = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert job.tokens == alone(ours, prompt) == library[:len(job.tokens)]
        assert pool.manager.num_used == 0
        pool.manager.check()


def test_a_paged_batch_gives_each_request_its_tokens_alone(small, tokenizer, stop, alone):
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    jobs = [Job(f"r{i}", p, 32, stop) for i, p in enumerate(prompts)]
    pool = BlockPool.for_model(small, 64)
    batch = run_paged(small, jobs, pool, arrivals=[0, 0, 3, 5])
    assert [j.tokens for j in jobs] == [alone(small, p) for p in prompts]
    assert batch.preempted == 0 and pool.hits > 0  # the course's system prompt is shared
    assert pool.manager.num_used == 0
    pool.manager.check()


def test_prefix_hits_skip_the_shared_document_and_keep_the_tokens(small, tokenizer, stop, alone):
    prompts = [handbook_ids(tokenizer, q) for q in HANDBOOK_QUESTIONS[:2]]
    pool = BlockPool.for_model(small, 200)
    for p in prompts:
        job = Job("q", p, 32, stop)
        run_paged(small, [job], pool)
        assert job.tokens == alone(small, p)
    assert pool.hits >= 1_000  # the second question found the handbook's blocks
    shared = pool.manager.match(paged.prefix_hashes(prompts[0]))
    before = torch.stack([pool.keys[0][b * 16:(b + 1) * 16] for b in shared])
    job = Job("q", handbook_ids(tokenizer, HANDBOOK_QUESTIONS[2]), 4, stop)
    run_paged(small, [job], pool)
    after = torch.stack([pool.keys[0][b * 16:(b + 1) * 16] for b in shared])
    assert torch.equal(before, after)  # a shared block is read, never written


def test_preempted_requests_are_recomputed_and_answer_as_if_alone(ours, small, tokenizer, stop, alone):
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    for m in (small, ours):  # the tiny model runs every answer to 32 tokens; the real one stops some early
        jobs = [Job(f"r{i}", p, 32, stop) for i, p in enumerate(prompts)]
        pool = BlockPool.for_model(m, 12)  # room for about three answers at a time, not four
        batch = run_paged(m, jobs, pool)
        assert batch.preempted >= 1 and batch.recomputed_tokens > 0
        assert [j.tokens for j in jobs] == [alone(m, p) for p in prompts]
        assert all(j.finish_reason in ("end_of_turn", "max_new_tokens") for j in jobs)
        assert pool.manager.num_used == 0
        pool.manager.check()


def test_reject_turns_away_what_it_cannot_reserve_and_never_preempts(small, tokenizer, stop, alone):
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    jobs = [Job(f"r{i}", p, 32, stop) for i, p in enumerate(prompts)]
    pool = BlockPool.for_model(small, 12)
    batch = run_paged(small, jobs, pool, policy="reject")
    assert batch.preempted == 0 and batch.rejected >= 1
    for job, prompt in zip(jobs, prompts):
        assert job.finish_reason == REJECTED or job.tokens == alone(small, prompt)
    assert pool.manager.num_used == 0


def test_a_prompt_bigger_than_the_pool_is_rejected_not_hung(small, tokenizer, stop):
    job = Job("big", handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0]), 8, stop)
    batch = run_paged(small, [job], BlockPool.for_model(small, 8))
    assert job.finish_reason == REJECTED and batch.rejected == 1


def test_a_cancelled_job_gives_its_blocks_back(small, tokenizer, stop):
    pool = BlockPool.for_model(small, 16)
    batch = PagedScheduler(small, pool)
    job = Job("c", chat_ids(tokenizer, QUESTIONS[0]), 32, stop)
    batch.add([job])
    step(batch)
    assert pool.manager.num_used > 0
    job.cancelled = True
    step(batch)
    assert job.finish_reason == "cancelled" and not batch.jobs and pool.manager.num_used == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "evict"}, "policy must be one of"), ({"max_batch": 0}, "max_batch"), ({"arrivals": [0, 1]}, "arrival"),
])
def test_bad_scheduler_arguments_are_refused(ours, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_paged(ours, [Job("a", [1, 2], 2)], BlockPool.for_model(ours, 4), **kwargs)


def test_footprint_counts_blocks_slots_and_sharing():
    r = paged.footprint([[1, 2, 3], [1, 2, 4]], 2)
    assert (r["blocks"], r["slots"], r["empty_slots"], r["shared_blocks"], r["table_entries"]) == (3, 6, 2, 1, 4)
    one = paged.footprint([[1, 2, 3], [1, 2, 4]], 1)  # blocks of one token: nothing empty, the common [1, 2] shared
    assert (one["blocks"], one["empty_slots"], one["shared_blocks"]) == (4, 0, 2)


@pytest.mark.parametrize("prompt, new, message", [([], 4, "empty"), ("hello", 4, "text"), ([1, 10**9], 4, "vocabulary"),
                                                  ([1, 2], 0, "max_new_tokens")])
def test_bad_jobs_are_refused_when_queued(small, prompt, new, message):
    batch = PagedScheduler(small, BlockPool.for_model(small, 4))
    with pytest.raises((ValueError, TypeError), match=message):
        batch.add([Job("bad", prompt, new)])
    assert not batch.jobs


def test_two_jobs_with_one_name_are_refused(small):
    batch = PagedScheduler(small, BlockPool.for_model(small, 4))
    with pytest.raises(ValueError, match="unique"):
        batch.add([Job("a", [1, 2], 2), Job("a", [3, 4], 2)])


def test_footprint_refuses_a_bad_block_size():
    with pytest.raises(ValueError, match="whole number"):
        paged.footprint([[1, 2]], 0)


def test_reserve_and_wait_finishes_everything_without_preempting(small, tokenizer, stop, alone):
    """The pool where reject turns requests away: reserve-and-wait turns nobody away and never preempts; some
    jobs wait in the queue for a reservation, and every job gets the tokens it gets alone."""
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    jobs = [Job(f"r{i}", p, 32, stop) for i, p in enumerate(prompts)]
    pool = BlockPool.for_model(small, 12)
    batch = run_paged(small, jobs, pool, policy="reserve")
    assert batch.preempted == 0 and batch.rejected == 0
    assert all(j.finish_reason in ("end_of_turn", "max_new_tokens") for j in jobs)
    assert [j.tokens for j in jobs] == [alone(small, p) for p in prompts]
    queued = {who: t for t, who, what in batch.events if what == "queued"}
    admitted = {}
    for t, who, what in batch.events:
        if what == "admitted":
            admitted.setdefault(who, t)
    assert set(queued) == {j.name for j in jobs}
    first_end = min(j.end for j in jobs)
    assert any(admitted[n] >= first_end for n in queued)  # someone waited until another finished
    assert pool.manager.num_used == 0
    pool.manager.check()


@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_other_block_sizes_give_the_same_tokens(small, tokenizer, stop, alone, block_size):
    """Slot arithmetic that block size 16 could hide: a block of one token, an odd size, one larger than a prompt;
    on a pool tight enough to preempt (block size 1 and 3) and with two prompts sharing their start."""
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    jobs = [Job(f"r{i}", p, 16, stop) for i, p in enumerate(prompts)]
    tokens = max(len(p) for p in prompts) + 16
    blocks = {1: 3 * tokens, 3: tokens, 64: 8}[block_size]
    pool = BlockPool.for_model(small, blocks, block_size=block_size)
    run_paged(small, jobs, pool)
    assert [j.tokens for j in jobs] == [alone(small, p)[:16] for p in prompts]
    assert pool.manager.num_used == 0
    pool.manager.check()


def test_sampled_requests_under_preemption_draw_what_they_draw_with_room(ours, small, tokenizer, stop):
    """A preempted request is recomputed from its prompt and the tokens it already has: its sampler must not be
    asked again for those, so each seeded request's tokens match a run on a pool with room for all."""
    from course_lib.engine.sampling import SamplingConfig, make_sampler
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    config = SamplingConfig(temperature=0.9, top_p=0.95)

    def run(m, blocks):
        jobs = [Job(f"r{i}", p, 32, stop, pick=make_sampler(config, seed=i)) for i, p in enumerate(prompts)]
        pool = BlockPool.for_model(m, blocks)
        batch = run_paged(m, jobs, pool)
        assert pool.manager.num_used == 0
        return [j.tokens for j in jobs], batch.preempted

    for m in (small, ours):
        roomy, none = run(m, 100)
        tight, preempted = run(m, 12)
        assert none == 0 and preempted >= 1  # the tight pool did preempt; the roomy one did not
        assert tight == roomy


def test_prefix_hits_and_preemption_together_keep_the_real_model_tokens(ours, tokenizer):
    """Three handbook questions share the document's blocks, on a pool too small for all three answers at once:
    some requests are preempted, the prefix stays shared, and every request answers as if alone."""
    prompts = [handbook_ids(tokenizer, q) for q in HANDBOOK_QUESTIONS[:3]]
    need = -(-len(prompts[0]) // 16)  # blocks of one prompt
    jobs = [Job(f"h{i}", p, 24, frozenset()) for i, p in enumerate(prompts)]
    pool = BlockPool.for_model(ours, need + 6)  # one document, and a few blocks for every request's own tail
    batch = run_paged(ours, jobs, pool)
    assert pool.hits > 0 and batch.preempted >= 1
    for job, prompt in zip(jobs, prompts):
        assert job.tokens == generate(ours, tokenizer, prompt, max_new_tokens=24, stop_ids=()).token_ids
    assert pool.manager.num_used == 0
    pool.manager.check()


def test_the_watermark_damps_admit_then_preempt_churn(small, tokenizer):
    """Eight requests on a 10-block pool: admitted as soon as their prompt fits (watermark 0), newcomers are
    preempted again and again as the running answers grow; keeping 4 blocks free at admission preempts and
    recomputes less, and every request's tokens stay the same."""
    questions = QUESTIONS + ["Tell me a joke.", "What is 2 + 2?", "Say hi.", "Name a fruit."]
    runs = {}
    for watermark in (0, 4):
        jobs = [Job(f"r{i}", chat_ids(tokenizer, q), 40) for i, q in enumerate(questions)]
        pool = BlockPool.for_model(small, 10)
        batch = PagedScheduler(small, pool, "preempt", 8, watermark=watermark)
        batch.add(jobs)
        while batch.jobs:
            step(batch)
        assert pool.manager.num_used == 0
        runs[watermark] = (batch.preempted, batch.recomputed_tokens, [j.tokens for j in jobs])
    assert runs[4][0] < runs[0][0] and runs[4][1] < runs[0][1]
    assert runs[4][2] == runs[0][2]


def test_a_preempted_request_finding_its_own_blocks_is_not_a_prefix_hit(small, tokenizer, stop):
    """Under preemption, readmitted sequences often find their own blocks still cached: counted apart
    (refound_rate), so hit_rate measures sharing between first admissions only."""
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    jobs = [Job(f"r{i}", p, 32, stop) for i, p in enumerate(prompts)]
    pool = BlockPool.for_model(small, 12)
    batch = run_paged(small, jobs, pool)
    assert batch.preempted >= 1 and pool.readmitted > 0 and pool.refound > 0
    assert pool.lookups == sum(len(p) for p in prompts)  # each prompt looked up once, at its first admission
    assert pool.hits <= pool.lookups and pool.refound <= pool.readmitted


def test_a_cache_salt_keeps_equal_prefixes_apart():
    """Equal tokens under different salts get different block names, so they never share a block; the same salt
    shares as before; no salt is the plain chain."""
    tokens = list(range(1000, 1040))
    assert paged.prefix_hashes(tokens) != paged.prefix_hashes(tokens, salt="alice")
    assert paged.prefix_hashes(tokens, salt="alice") != paged.prefix_hashes(tokens, salt="bob")
    assert paged.prefix_hashes(tokens, salt="alice") == paged.prefix_hashes(tokens, salt="alice")
    pool = BlockPool(1, 1, 1, 20)
    found = []
    for salt in ("alice", "bob", "alice", ""):
        seq = Sequence(list(tokens), salt=salt)
        found.append(pool.admit(seq))
        pool.grow(seq, len(tokens))
        pool.commit(seq, len(tokens) - seq.computed)
        assert seq.names == paged.prefix_hashes(tokens, salt=salt)  # committed names carry the salt too
    assert found == [0, 0, 32, 0]  # only alice's second request finds alice's blocks


def test_a_fork_shares_the_prompt_and_copies_its_last_block_on_write(small, tokenizer):
    """Parallel sampling's fork: two branches from one prefilled prompt (37 tokens: two full blocks and a partial
    one), fed different tokens, then decoded greedily together. The full blocks stay shared, the partial one is
    copied once, and every step's logits equal the branch's whole sequence run from scratch."""
    from course_lib.runner.forward import forward_logits
    from course_lib.engine.stages import decode_step, prefill
    prompt = chat_ids(tokenizer, "What is the capital of France?")[:37]
    pool = BlockPool.for_model(small, 20)
    a = Sequence(list(prompt))
    pool.admit(a)
    pool.grow(a, len(prompt))
    prefill(small, prompt, cache=pool.view([a]))
    b = pool.fork(a)
    assert b.blocks == a.blocks and pool.manager.num_used == 3 and pool.copied == 0
    branches = [(a, prompt + [1000]), (b, prompt + [2000])]  # each branch's tokens, the last one still to feed
    for _ in range(5):
        for seq, tokens in branches:
            pool.grow(seq, len(tokens))
        view = pool.view([seq for seq, _ in branches])
        logits, _ = decode_step(small, [tokens[-1] for _, tokens in branches], view,
                                attention_mask=view.attention_mask(1), positions=view.positions())
        for row, (seq, tokens) in enumerate(branches):
            reference = forward_logits(small, tokens)[0, -1]
            assert torch.allclose(logits[row], reference, atol=1e-4, rtol=0)
            tokens.append(int(logits[row].argmax()))
    assert pool.copied == 1  # the partial block, once
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]  # the full blocks stay shared
    assert pool.manager.num_used == 4
    for seq in (a, b):
        pool.free(seq)
    assert pool.manager.num_used == 0
    pool.manager.check()


def test_n_answers_fork_one_prompt_and_each_draws_what_it_draws_alone(small, tokenizer, stop):
    """n > 1: the first job reads the prompt, the others fork its blocks (copy-on-write) and pick from the same
    logits. Each seeded answer equals its seed run alone; the prompt is read once; fewer blocks are held than by n
    separate requests; a tight pool preempts forks and they still answer the same."""
    from course_lib.engine.sampling import SamplingConfig, make_sampler
    prompt = handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])[:200]  # 12 full blocks and a partial one
    config = SamplingConfig(temperature=1.0)

    def jobs(n, fork=True):
        out = [Job(f"a{i}", list(prompt), 24, stop, pick=make_sampler(config, seed=i)) for i in range(n)]
        for job in out[1:]:
            job.fork_of = "a0" if fork else ""
        return out

    alone = []
    for i in range(4):
        job = jobs(i + 1, fork=False)[i]
        run_paged(small, [job], BlockPool.for_model(small, 64, prefix_caching=False))
        alone.append(job.tokens)
    assert len({tuple(t) for t in alone}) > 1  # the seeds do give different answers

    peaks = {}
    for fork in (True, False):
        pool = BlockPool.for_model(small, 128, prefix_caching=False)
        group = jobs(4, fork)
        batch = run_paged(small, group, pool)
        assert [j.tokens for j in group] == alone
        assert batch.forked == (3 if fork else 0) and batch.prefill_chunks == (1 if fork else 4)
        peaks[fork] = max(used for _, used, _ in batch.memory)
        assert pool.manager.num_used == 0
        pool.manager.check()
    assert peaks[True] < peaks[False] - 2 * (len(prompt) // 16)  # the prompt's full blocks are held once, not 4 times

    pool = BlockPool.for_model(small, 18, prefix_caching=False)  # room for the prompt and little more: forks preempted
    group = jobs(4)
    batch = run_paged(small, group, pool)
    assert batch.preempted >= 1 and [j.tokens for j in group] == alone
    assert pool.manager.num_used == 0
    pool.manager.check()


def test_forks_of_a_leader_that_leaves_early_run_alone(small, tokenizer, stop, alone):
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    pool = BlockPool.for_model(small, 32)
    batch = PagedScheduler(small, pool)
    group = [Job("a", prompt, 8, stop), Job("b", prompt, 8, stop, fork_of="a")]
    group[0].cancelled = True  # the leader leaves before its prompt is read: its sibling is served on its own
    batch.add(group)
    while batch.jobs:
        step(batch)
    assert group[0].finish_reason == "cancelled" and group[1].tokens == alone(small, prompt)[:8]
    assert batch.forked == 0 and pool.manager.num_used == 0
    # a sibling listed before its leader, the leader then refused (its allowance cannot fit): the sibling runs alone
    batch = PagedScheduler(small, BlockPool.for_model(small, 6))
    group = [Job("b", prompt, 8, stop, fork_of="a"), Job("a", prompt, 500, stop)]
    batch.add(group)
    while batch.jobs:
        step(batch)
    assert group[1].finish_reason == REJECTED and group[0].tokens == alone(small, prompt)[:8]


def test_a_fork_group_that_cannot_run_side_by_side_is_refused(small, tokenizer, stop):
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    batch = PagedScheduler(small, BlockPool.for_model(small, 32), max_batch=2)
    with pytest.raises(ValueError, match="asks for 3 answers but this scheduler runs at most 2"):
        batch.add([Job("a", prompt, 8, stop)] + [Job(f"b{i}", prompt, 8, stop, fork_of="a") for i in range(2)])
    with pytest.raises(ValueError, match="prompts .* differ"):
        batch.add([Job("a", prompt, 8, stop), Job("b", prompt[:-1], 8, stop, fork_of="a")])
