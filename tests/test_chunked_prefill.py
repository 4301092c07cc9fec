"""Chunked prefill and the token budget (issue: the engine as one step): a prompt read in chunks gives the logits
of one whole prefill (within 1e-4 in float32) on either cache and the same greedy tokens; a long prompt no longer
stalls the running requests; admission keeps headroom; what can never fit is refused before any token."""
import pytest

from course_lib.engine.paged_scheduler import REJECTED, PagedScheduler
from course_lib.engine.request import end_of_turn_ids, Job
from course_lib.engine.generation import generate, run_paged, step
from course_lib.text.context import HANDBOOK_QUESTIONS, chat_ids, handbook_ids
from course_lib.engine.stages import prefill
from course_lib.runner.model import Model
from course_lib.runner.paged import BlockPool
from course_lib.runner.blocks import Sequence

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about rain."]


@pytest.fixture(scope="module")
def ours(model):
    return Model.from_transformers(model)


@pytest.fixture(scope="module")
def small(tiny):
    return Model.from_transformers(tiny)


@pytest.fixture(scope="module")
def stop(model, tokenizer):
    return frozenset(end_of_turn_ids(model, tokenizer))


def chunked(model, ids, size, cache):
    """prefill the prompt `size` tokens at a time on `cache`; the last chunk's last-position logits (V,)."""
    for start in range(0, len(ids), size):
        logits, cache = prefill(model, ids[start:start + size], cache)
    return logits[0]


def paged_cache(model, ids):
    pool = BlockPool.for_model(model, 16)
    seq = Sequence(list(ids))
    pool.grow(seq, len(ids))
    return pool.view([seq])


@pytest.mark.parametrize("size", [1, 7, 16, 33])
def test_chunked_prefill_gives_the_whole_prefills_logits(ours, tokenizer, size):
    ids = chat_ids(tokenizer, "Why is the sky blue? Answer in two sentences.")
    whole = prefill(ours, ids)[0][0]
    for make in (lambda: ours.new_cache(1, len(ids) + 8), lambda: paged_cache(ours, ids)):
        got = chunked(ours, ids, size, make())
        assert (got - whole).abs().max() < 1e-4, size
        assert int(got.argmax()) == int(whole.argmax())


def test_chunked_prefill_on_the_library_cache(tiny, tokenizer):
    ids = chat_ids(tokenizer, "Name three colours.")
    whole = prefill(tiny, ids)[0][0]
    assert (chunked(tiny, ids, 5, None) - whole).abs().max() < 1e-4  # None: prefill makes a DynamicCache


@pytest.mark.parametrize("budget", [9, 24, 100])
def test_a_budget_keeps_every_requests_tokens(small, tokenizer, stop, budget):
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS] + [handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])]
    alone = [generate(small, tokenizer, p, 24, stop_ids=stop).token_ids for p in prompts]
    jobs = [Job(f"r{i}", p, 24, stop) for i, p in enumerate(prompts)]
    pool = BlockPool.for_model(small, 160)
    batch = run_paged(small, jobs, pool, arrivals=[0, 0, 2, 3, 1], token_budget=budget)
    assert [j.tokens for j in jobs] == alone
    assert batch.prefill_chunks >= len(prompts[-1]) // budget  # the handbook was read in chunks
    assert pool.manager.num_used == 0
    pool.manager.check()


def test_running_requests_get_a_token_every_step_while_a_long_prompt_is_read(small, tokenizer, stop):
    short, long = chat_ids(tokenizer, QUESTIONS[0]), handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])
    for budget, expect_stall in ((64, False), (None, True)):
        a, b = Job("short", short, 40), Job("long", long, 4)
        batch = PagedScheduler(small, BlockPool.for_model(small, 160), token_budget=budget)
        batch.add([a])
        step(batch)
        batch.add([b])
        counts, calls = [], []
        while not b.tokens:
            before = batch.prefill_chunks
            step(batch)
            counts.append(len(a.tokens))
            calls.append(batch.prefill_chunks - before)
        assert all(y == x + 1 for x, y in zip([1] + counts, counts))  # one token per step, whatever the budget
        steps_reading = len(counts)
        assert (steps_reading == 1) == expect_stall  # whole: read in one step; chunked: over several
        if budget:
            assert steps_reading >= len(b.prompt) // budget and max(calls) == 1


def test_budget_and_watermark_arguments_are_checked(small):
    pool = BlockPool.for_model(small, 10)
    for kwargs, message in (({"token_budget": 8}, "above max_batch"), ({"token_budget": 2.5}, "token_budget"),
                            ({"watermark": 10}, "watermark"), ({"watermark": -1}, "watermark")):
        with pytest.raises(ValueError, match=message):
            PagedScheduler(small, pool, **kwargs)


def test_what_could_never_fit_is_refused_before_any_token(small, tokenizer, stop):
    pool = BlockPool.for_model(small, 6)  # 96 token slots
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    big = Job("big", prompt, 96, stop)  # its prompt fits, but not with everything it may write
    ok = Job("ok", prompt, 8, stop)
    batch = run_paged(small, [big, ok], pool)
    assert big.finish_reason == REJECTED and big.tokens == [] and batch.rejected == 1
    assert ok.finish_reason in ("end_of_turn", "max_new_tokens") and ok.tokens


def test_admission_keeps_the_watermark_free(small, tokenizer, stop):
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    pool = BlockPool.for_model(small, 14)
    batch = PagedScheduler(small, pool, watermark=3)
    batch.add([Job(f"r{i}", p, 8, stop) for i, p in enumerate(prompts)])
    batch._admit()
    assert len(batch.running) >= 1
    assert len(batch.running) == 1 or pool.manager.num_free >= 3


def test_the_paged_view_rolls_back(ours, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    pool = BlockPool.for_model(ours, 8)
    seq = Sequence(list(ids) + [42] * 20)
    pool.grow(seq, len(seq.tokens))
    view = pool.view([seq])
    want = prefill(ours, ids, view)[0][0]
    prefill(ours, [42] * 20, view)  # enough to fill and name another block
    named = len(seq.names)
    view.rollback(len(ids))
    assert seq.computed == len(ids) and len(seq.names) < named
    assert all(pool.manager.hash_of.get(b) is None for b in seq.blocks[len(seq.names):])
    view.rollback(len(ids) - 1)
    got = prefill(ours, ids[-1:], view)[0][0]
    assert (got - want).abs().max() < 1e-4
    with pytest.raises(ValueError, match="roll back"):
        view.rollback(len(ids) + 5)
