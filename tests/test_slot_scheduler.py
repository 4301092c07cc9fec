"""Slots (engine/slot_scheduler.py, q4_kernel.cpp's step_tokens): a row of one cache per request, each step one fused
call over decode tokens and prompt chunks. A prompt read in chunks gives the logits of reading it a token at a
time, bit for bit, and near the eager model's; a request's tokens do not depend on what shares its steps or on the
token budget; rows are freed and reused; bad options, requests that do not fit and bad cells are refused clearly;
the server runs it when asked."""
import threading

import pytest
import torch

from course_lib.engine.generation import step
from course_lib.engine.request import Job
from course_lib.engine.slot_scheduler import SlotScheduler
from course_lib.runner import formats, q4_kernel
from course_lib.runner.fused_step import FusedDecode
from course_lib.runner.kv_cache import KVCache
from course_lib.runner.model import Model

AVAILABLE, WHY = q4_kernel.available()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=WHY or "available")


@pytest.fixture(scope="module")
def small_q8(tiny):
    return formats.convert(Model.from_transformers(tiny), "int4-q8")


@needs_kernel
def test_a_chunk_equals_its_tokens_one_at_a_time_and_reads_no_later_column(small_q8, tokenizer):
    prompt = tokenizer.encode("A prompt read in chunks, each token seeing only what came before it")
    n, fused = len(prompt), FusedDecode(small_q8)
    whole, single = small_q8.new_cache(3, 64), small_q8.new_cache(3, 64)
    for cache in (whole, single):  # columns never written hold garbage: no token may read them
        for layer in range(len(cache.keys)):
            cache.keys[layer].fill_(float("nan"))
            cache.values[layer].fill_(float("nan"))
    got = fused.tokens_at(prompt, whole, [2] * n, list(range(n)), list(range(n)))  # row 2, all at once
    one_by_one = torch.cat([fused.tokens_at([t], single, [2], [i], [0]) for i, t in enumerate(prompt)])
    assert torch.isfinite(got).all()
    assert torch.equal(got, one_by_one)
    with torch.inference_mode():
        eager = small_q8(torch.tensor([prompt]), cache=small_q8.new_cache(1, 64)).logits[0]  # (n, V)
    assert float((got - eager).abs().max()) <= 0.05 * float(eager.abs().max())
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    assert torch.isnan(whole.keys[0][[0, 1]]).all()  # the other rows untouched


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_across_column_tiles_and_beside_decode_tokens_equal_one_at_a_time(small_q8, tokenizer, dtype):
    # the kernel reads columns 64 at a time and a chunk's tokens 4 at a time: chunks of 37 and 30 tokens cross tiles
    # and runs, beside a decode token of another row, on a float cache (one head at a time) and a bfloat16 one
    prompt = tokenizer.encode("Every token of a long prompt sees the ones before it and none after. " * 8)[:100]
    other = tokenizer.encode("Another request decodes beside it.")
    n, fused = len(prompt), FusedDecode(small_q8)
    caches = [KVCache(len(small_q8.layers), 2, small_q8.kv_heads, small_q8.head_dim, 128, dtype, "cpu")
              for _ in range(2)]
    for cache in caches:
        for layer in range(len(cache.keys)):
            cache.keys[layer].fill_(float("nan"))
            cache.values[layer].fill_(float("nan"))
    chunked, single = caches
    for cache in caches:
        fused.tokens_at(other, cache, [1] * len(other), list(range(len(other))), [])
    got, start = [], 0
    for size in (37, 30, n - 67):
        ids = [other[0]] + prompt[start:start + size]  # the other row's next token first, then the chunk
        rows, columns = [1] + [0] * size, [len(other) + len(got)] + list(range(start, start + size))
        got.append(fused.tokens_at(ids, chunked, rows, columns, list(range(size + 1))))
        start += size
    got = torch.cat(got)
    alone = []
    for step, size in enumerate((37, 30, n - 67)):
        alone.append(fused.tokens_at([other[0]], single, [1], [len(other) + step], [0]))
        first = sum((37, 30, n - 67)[:step])
        alone += [fused.tokens_at([t], single, [0], [first + i], [0]) for i, t in enumerate(prompt[first:first + size])]
    assert n == 100 and torch.isfinite(got).all()
    assert torch.equal(got, torch.cat(alone))


@needs_kernel
def test_bad_cells_are_refused_by_the_kernel(small_q8):
    fused, cache = FusedDecode(small_q8), small_q8.new_cache(2, 16)
    with pytest.raises(RuntimeError, match="two tokens at one row and column"):
        fused.tokens_at([5, 6], cache, [0, 0], [3, 3], [1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.tokens_at([5], cache, [2], [0], [0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.tokens_at([5], cache, [0], [16], [0])
    with pytest.raises(ValueError, match="one each"):
        fused.tokens_at([5, 6], cache, [0], [0], [0])


def _jobs(tokenizer, new_tokens=6):
    texts = ["The first request", "A second, longer request that takes several chunks to read in full",
             "Third", "The fourth request comes last, while the others answer: long enough for several chunks"]
    return [Job(f"r{i}", tokenizer.encode(t), new_tokens) for i, t in enumerate(texts)]


def _serve(scheduler, jobs, later=()):
    """Drive `scheduler` with `jobs`, then `later` added at the third step; returns the steps run."""
    scheduler.add(list(jobs))
    steps = 0
    while scheduler.jobs or later:
        if steps == 2 and later:
            scheduler.add(list(later))
            later = ()
        step(scheduler)
        steps += 1
        assert steps < 500, "the scheduler stopped making progress"
    return steps


@needs_kernel
def test_each_requests_tokens_do_not_depend_on_what_shares_its_steps(small_q8, tokenizer):
    alone = []
    for job in _jobs(tokenizer):
        _serve(SlotScheduler(small_q8, slots=1, capacity=64, token_budget=None), [job])
        alone.append(job.tokens)
    runs = {}
    for budget in (None, 5):  # whole prompts, and at most 5 tokens a step, decode rows included
        jobs = _jobs(tokenizer)
        scheduler = SlotScheduler(small_q8, slots=4, capacity=64, token_budget=budget)
        runs[budget] = _serve(scheduler, jobs[:3], later=jobs[3:])  # the last comes while three decode
        assert [j.tokens for j in jobs] == alone
        assert all(j.finish_reason == "max_new_tokens" for j in jobs)
        assert scheduler.rows == [None] * 4 and not scheduler.row_of  # every row given back
    assert runs[5] > runs[None]  # the budget spread the prompts over more steps
    sizes = list(scheduler.step_sizes)
    assert all(total <= 5 for decoding, total in sizes if decoding)  # while anyone decodes: at most the budget
    assert max(total for decoding, total in sizes if not decoding) > 5  # nobody waiting between tokens: more


@needs_kernel
def test_with_nobody_decoding_a_long_prompt_goes_in_idle_chunks_that_pick_nothing(small_q8, tokenizer, monkeypatch):
    import course_lib.engine.slot_scheduler as slots
    job, alone = _jobs(tokenizer)[1], _jobs(tokenizer)[1]
    _serve(SlotScheduler(small_q8, slots=1, capacity=64, token_budget=None), [alone])
    monkeypatch.setattr(slots, "IDLE_CHUNK", 4)
    scheduler = SlotScheduler(small_q8, slots=1, capacity=64, token_budget=2)
    scheduler.add([job])
    assert step(scheduler) == [] and scheduler.read[job.name] == 4  # 4 tokens read, nothing to pick yet
    while scheduler.jobs:
        step(scheduler)
    assert job.tokens == alone.tokens
    assert max(total for decoding, total in scheduler.step_sizes if not decoding) == 4


@needs_kernel
def test_a_waiting_request_takes_a_freed_row_and_a_cancelled_one_frees_its_own(small_q8, tokenizer):
    jobs = _jobs(tokenizer, new_tokens=4)
    scheduler = SlotScheduler(small_q8, slots=1, capacity=64, token_budget=None)
    scheduler.add(jobs[:2])
    step(scheduler)
    assert scheduler.rows == [jobs[0]] and scheduler.waiting == [jobs[1]]
    jobs[0].cancelled = True
    step(scheduler)
    assert jobs[0].finish_reason == "cancelled" and scheduler.rows == [jobs[1]]
    while scheduler.jobs:
        step(scheduler)
    assert len(jobs[1].tokens) == 4


@needs_kernel
def test_a_row_keeps_its_last_requests_columns_for_a_prompt_that_starts_the_same(small_q8, tokenizer):
    system = tokenizer.encode("A long shared system prompt, the same for both requests, read once.")
    first, second = Job("a", system + tokenizer.encode(" First?"), 5), Job("b", system + tokenizer.encode(" Next?"), 5)
    other = Job("c", tokenizer.encode("Nothing in common"), 5)
    alone = Job("b", list(second.prompt), 5)
    _serve(SlotScheduler(small_q8, slots=2, capacity=64, token_budget=None), [alone])
    scheduler = SlotScheduler(small_q8, slots=2, capacity=64, token_budget=None)
    _serve(scheduler, [first])
    row = scheduler.written.index(max(scheduler.written, key=len))  # the row the first request wrote
    _serve(scheduler, [second])
    assert scheduler.reused_tokens == len(system) and second.tokens == alone.tokens  # bit for bit: the same columns
    assert scheduler.written[row][:len(second.prompt)] == second.prompt  # it took that row, not the empty one
    _serve(scheduler, [other])
    assert scheduler.reused_tokens == len(system)  # nothing shared: nothing kept
    same = Job("d", list(other.prompt), 5)
    _serve(scheduler, [same])  # the whole prompt seen before: all but its last token kept (its logits are needed)
    assert scheduler.reused_tokens == len(system) + len(other.prompt) - 1 and same.tokens == other.tokens


@needs_kernel
def test_a_newcomer_that_shares_nothing_takes_the_row_with_least_to_lose(small_q8, tokenizer):
    document = tokenizer.encode("A long handbook every later question quotes in full, kept for them. " * 3)
    scheduler = SlotScheduler(small_q8, slots=2, capacity=128, token_budget=None)
    _serve(scheduler, [Job("doc", document + tokenizer.encode(" First?"), 4)])
    kept = scheduler.written.index(max(scheduler.written, key=len))
    _serve(scheduler, [Job("chat", tokenizer.encode("Nothing in common"), 4)])  # both rows share nothing with it
    assert scheduler.written[kept][:len(document)] == document  # it took the empty row: the handbook stays
    _serve(scheduler, [Job("doc2", document + tokenizer.encode(" Second?"), 4)])
    assert scheduler.reused_tokens >= len(document)


@needs_kernel
def test_what_does_not_fit_is_refused_on_arrival_and_bad_options_clearly(small_q8, tiny, tokenizer):
    scheduler = SlotScheduler(small_q8, slots=2, capacity=16, token_budget=None)
    long = Job("long", list(range(100, 112)), 8)  # 12 + 8 > 16 columns
    fits = Job("fits", list(range(100, 108)), 8)
    scheduler.add([long, fits])
    assert long.finish_reason == "rejected" and scheduler.rejected == 1 and scheduler.waiting == [fits]
    assert scheduler.fits(16) and not scheduler.fits(17)
    with pytest.raises(ValueError, match="names must be unique"):
        scheduler.add([Job("fits", [5], 2)])
    with pytest.raises(ValueError, match="slots run the fused step"):
        SlotScheduler(Model.from_transformers(tiny))  # float32: no fused step
    with pytest.raises(ValueError, match="token_budget must be a whole number of tokens above max_batch"):
        SlotScheduler(small_q8, slots=4, token_budget=4)
    with pytest.raises(ValueError, match="capacity must be"):
        SlotScheduler(small_q8, capacity=10**6)
    with pytest.raises(ValueError, match="slots must be"):
        SlotScheduler(small_q8, slots=0)


@needs_kernel
def test_the_server_runs_slots_when_asked(tiny, tokenizer):
    import httpx
    from course_lib.serve.serving import create_app, free_port, start_server
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say something"}],
            "temperature": 0, "max_tokens": 6}
    handle = start_server(tiny, tokenizer, port=free_port(), fmt="int4-q8", compiled=True, kv_cache="slots",
                          token_budget=12, slot_capacity=256)
    try:
        assert type(handle.app.state.engine.batch).__name__ == "SlotScheduler"
        reply = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 6
        health = httpx.get(handle.url + "/health", timeout=10).json()
        assert health["slots"]["total"] == 8 and health["slots"]["steps"] >= 6
        long = {**body, "messages": [{"role": "user", "content": "word " * 300}]}
        refused = httpx.post(handle.url + "/v1/chat/completions", json=long, timeout=60)
        assert refused.status_code == 400 and "context_length_exceeded" in refused.text
        # the loop moved to a thread of the caller's (the sittings' server runs it in its main thread): the
        # background thread ends, the same scheduler goes on answering, and stop() ends the caller's loop
        engine = handle.app.state.engine
        caller = threading.Thread(target=engine.run_here)
        caller.start()
        again = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=60)
        assert not engine.thread.is_alive() and caller.is_alive()
        assert again.status_code == 200
        assert again.json()["choices"][0]["message"] == reply.json()["choices"][0]["message"]
    finally:
        handle.stop()
    caller.join(timeout=10)
    assert not caller.is_alive()
    with pytest.raises(ValueError, match="pass compiled=True"):
        create_app(tiny, tokenizer, fmt="int4-q8", kv_cache="slots")
    with pytest.raises(ValueError, match="options of the paged cache; slots have slot_capacity"):
        create_app(tiny, tokenizer, fmt="int4-q8", compiled=True, kv_cache="slots", kv_blocks=64)
