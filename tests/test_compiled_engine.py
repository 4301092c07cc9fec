"""The compiled step inside the engine (runner.compiled): the same runner contract, caches in buckets, the static
step for a decode step of a bucket's shape (one row or a left-padded batch), the eager model for everything else,
and the same tokens as the eager path; without a C++ compiler it says so and runs eagerly."""
import pytest
import torch

from course_lib.engine.generation import generate, run_schedule, stream
from course_lib.engine.request import Job
from course_lib.runner.compiled import CAPACITIES, CompiledRunner, bucket, compiled_runner
from course_lib.runner.forward import Runner
from course_lib.runner.model import Model
from course_lib.runner.static_step import compile_available


@pytest.fixture(scope="module")
def small(tiny):
    return Model.from_transformers(tiny)


def test_buckets_round_up_and_stop_at_the_window():
    assert bucket(1, 8192) == CAPACITIES[0] and bucket(257, 8192) == 512 and bucket(4096, 8192) == 4096
    assert bucket(5000, 6000) == 6000  # never past the window, even between buckets


def test_the_static_path_gives_the_eager_tokens_and_logits(small, tokenizer):
    runner = CompiledRunner(small, compile=False)  # the static steps, not compiled: the same code the compiler gets
    assert isinstance(runner, Runner)
    prompt = tokenizer.encode("The engine runs the static step when the shapes allow")
    want = generate(small, tokenizer, prompt, 12, stop_ids=())
    got = generate(runner, tokenizer, prompt, 12, stop_ids=())
    assert got.token_ids == want.token_ids
    assert [round(s.prob, 4) for s in got.steps] == [round(s.prob, 4) for s in want.steps]
    assert runner.static_calls == 11 and runner.eager_calls == 1  # the prompt eagerly, every decode step static
    assert list(runner.steps) == [(1, 256, torch.get_num_threads())]  # one bucket: 12 tokens fit in 256 columns


def test_a_left_padded_batch_runs_static_and_keeps_each_rows_tokens(small, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("A short one", "A rather longer prompt, padded on the left of the other")]
    want = [generate(small, tokenizer, p, 8, stop_ids=()).token_ids for p in prompts]
    runner = CompiledRunner(small, compile=False)
    jobs = [Job(f"r{i}", p, 8) for i, p in enumerate(prompts)]
    run_schedule(runner, jobs, max_batch=2, continuous=True)
    assert [j.tokens for j in jobs] == want
    assert (2, 256, torch.get_num_threads()) in runner.steps  # the two rows' decode steps ran as one static batch


class Fives:
    """A drafter that always proposes k fives: every step is a verify pass of k + 1 tokens."""

    def propose(self, context, k):
        return [5] * k


def test_drafts_and_other_shapes_fall_back_to_the_eager_model(small, tokenizer):
    runner = CompiledRunner(small, compile=False)
    prompt = tokenizer.encode("a verify pass is several tokens at once")
    want = generate(small, tokenizer, prompt, 10, stop_ids=(), draft=Fives(), k=3)
    got = generate(runner, tokenizer, prompt, 10, stop_ids=(), draft=Fives(), k=3)
    assert got.token_ids == want.token_ids
    assert runner.eager_calls == 1 + got.speculative.verify_steps and runner.static_calls == 0


def test_generate_and_stream_take_compiled_and_share_one_runner(small, tokenizer, monkeypatch):
    import course_lib.runner.compiled as compiled
    monkeypatch.setattr(compiled, "compile_available", lambda: (False, "no C++ compiler (a test)"))
    prompt = tokenizer.encode("Streamed through the compiled runner")
    want = generate(small, tokenizer, prompt, 6, stop_ids=())
    pieces = stream(small, tokenizer, prompt, 6, compiled=True)
    assert "".join(pieces) == pieces.result.text == want.text
    assert compiled_runner(small) is compiled_runner(small)


def test_without_a_cpp_compiler_it_says_so_and_runs_eagerly(small, tokenizer, monkeypatch, capsys):
    import course_lib.runner.compiled as compiled
    monkeypatch.setattr(compiled, "compile_available", lambda: (False, "no C++ compiler (a test)"))
    runner = CompiledRunner(small)
    assert "running eagerly" in capsys.readouterr().out and runner.why_eager
    prompt = tokenizer.encode("No compiler here")
    assert generate(runner, tokenizer, prompt, 5, stop_ids=()).token_ids == \
        generate(small, tokenizer, prompt, 5, stop_ids=()).token_ids
    assert runner.static_calls == 0 and not runner.steps


def test_a_transformers_model_is_refused_clearly(tiny, tokenizer):
    with pytest.raises(TypeError, match="Model.from_transformers"):
        generate(tiny, tokenizer, tokenizer.encode("hi"), 3, compiled=True)


@pytest.mark.slow
def test_generate_compiled_gives_the_eager_tokens(small, tokenizer):
    ok, why = compile_available()
    if not ok:
        pytest.skip(why)
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]  # other tests of the session compile too
    runner = CompiledRunner(small)
    prompt = tokenizer.encode("Compiled inside the engine")
    want = generate(small, tokenizer, prompt, 8, stop_ids=())
    got = generate(runner, tokenizer, prompt, 8, stop_ids=())
    assert got.token_ids == want.token_ids  # float32: the fused kernels add in another order, no near-tie here
    assert runner.steps[(1, 256, torch.get_num_threads())].compile_seconds > 0
    # a batch of three rows, then of five in a larger bucket: one more compile (a batch), then the same code
    prompts = [tokenizer.encode(t) for t in ("one", "two rows", "three rows here", "four", "five")]
    for rows, n in ((3, 6), (5, 300)):
        jobs = [Job(f"b{rows}{i}", p, n) for i, p in enumerate(prompts[:rows])]
        run_schedule(runner, jobs, max_batch=rows, continuous=True)
        assert [j.tokens for j in jobs] == [generate(small, tokenizer, p, n, stop_ids=()).token_ids for p in prompts[:rows]]
    assert {(3, 256), (5, 512)} <= {key[:2] for key in runner.steps} and len(runner.compiled_code) == 1
    assert counters["stats"]["unique_graphs"] - graphs <= 3  # a single row, a batch (and no graph per bucket)


@pytest.mark.slow
def test_a_warmed_runner_compiles_nothing_more_under_a_servers_traffic(small, tokenizer):
    """warm() is what a server pays before it listens: the engine's own calls afterwards (tensors made outside
    inference mode, a step called inside it, left-padded rows, caches of several buckets) must find its code. It
    warms at 512 columns: the tiny model's gate|up matrix has 256 rows, which torch would tie to a 256 capacity."""
    ok, why = compile_available()
    if not ok:
        pytest.skip(why)
    from torch._dynamo.utils import counters
    runner = CompiledRunner(small)
    assert runner.warm(512) > 0
    graphs = counters["stats"]["unique_graphs"]
    prompts = [list(range(5, 5 + n)) for n in (20, 300, 40, 600, 7)]  # buckets of 256, 512 and 1,024 columns
    jobs = [Job(f"w{i}", p, 6) for i, p in enumerate(prompts)]
    run_schedule(runner, jobs, max_batch=8, continuous=True)
    assert counters["stats"]["unique_graphs"] == graphs  # before the fix: a graph more for a batch, mid-traffic
    assert [j.tokens for j in jobs] == [generate(small, tokenizer, p, 6, stop_ids=()).token_ids for p in prompts]
    assert runner.static_calls >= 5


def test_rows_that_join_and_leave_keep_the_cache_in_a_bucket_and_their_tokens(small, tokenizer):
    """Continuous batching joins newcomers (left-padded) and drops finished rows: the scheduler hands the cache back
    to the runner's fit_cache, so the decode steps after a join still run static, with each row's own tokens."""
    texts = ("One", "Two words here", "A third prompt that is longer than the others", "Four", "Five and six")
    prompts = [tokenizer.encode(t) for t in texts]
    lengths = (3, 9, 5, 7, 4)  # rows finish at different steps: rows leave and newcomers join mid-batch
    want = [generate(small, tokenizer, p, n, stop_ids=()).token_ids for p, n in zip(prompts, lengths)]
    runner = CompiledRunner(small, compile=False)
    jobs = [Job(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]
    run_schedule(runner, jobs, max_batch=2, continuous=True)
    assert [j.tokens for j in jobs] == want
    assert runner.static_calls >= sum(lengths) // 2  # without fit_cache, every step after the first join ran eagerly
    assert all(rows in (1, 2) and capacity in CAPACITIES for rows, capacity, _ in runner.steps)
    fresh = small.new_cache(2, 300)  # a capacity between buckets, as a join leaves
    fresh.length = 40
    fitted = runner.fit_cache(fresh)
    assert fitted.capacity == 256 and fitted.length == 40
    assert torch.equal(fitted.keys[0][:, :, :40], fresh.keys[0][:, :, :40])
    assert runner.fit_cache(fitted) is fitted  # already a bucket: no copy


def test_the_server_runs_the_compiled_runner_when_asked(small, tokenizer, monkeypatch):
    import httpx
    import course_lib.runner.compiled as compiled
    from course_lib.serve.serving import create_app, free_port, start_server
    monkeypatch.setattr(compiled, "compiled_runner", lambda model: CompiledRunner(model, compile=False))
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say something"}],
            "temperature": 0, "max_tokens": 6}
    answers = {}
    for fast in (False, True):
        handle = start_server(small, tokenizer, port=free_port(), compiled=fast)
        try:
            reply = httpx.post(handle.url + "/v1/chat/completions", json=body, timeout=60).json()
            answers[fast] = reply["choices"][0]["message"]["content"]
            health = httpx.get(handle.url + "/health", timeout=10).json()
        finally:
            handle.stop()
        assert ("compiled" in health) is fast
    assert answers[True] == answers[False]
    assert health["compiled"]["static_steps"] >= 4 and health["compiled"]["why_eager"] == ""
    with pytest.raises(ValueError, match="paged cache's decode reads its block tables"):
        create_app(small, tokenizer, kv_cache="paged", compiled=True)
    with pytest.raises(ValueError, match="unknown weight format"):
        create_app(small, tokenizer, fmt="int3")
    with pytest.raises(ValueError, match="rows_int8 is an option of the 4-bit format"):
        create_app(small, tokenizer, rows_int8=6)
    with pytest.raises(ValueError, match="rows_int8 is for the 4-bit formats"):
        create_app(small, tokenizer, fmt="bfloat16", rows_int8=6)


@pytest.mark.skipif(not __import__("course_lib.runner.formats", fromlist=["x"]).int_mm_available(),
                    reason="torch._int_mm is missing or inexact here")
def test_a_server_model_in_int4_can_carry_the_int8_copy_for_several_rows(small, tokenizer):
    from course_lib.serve.engine_thread import fast_model
    from course_lib.engine.generation import generate
    plain, rows = fast_model(small, "int4"), fast_model(small, "int4", rows_int8=4)
    assert rows.layers[0].gate_up.int8 is not None and plain.layers[0].gate_up.int8 is None
    ids = tokenizer("The capital of France is")["input_ids"]
    assert len(ids) >= 4  # the prompt's prefill goes through the copy, each decode step (one row) through 4 bits
    out = generate(rows, tokenizer, ids, 4, stop_ids=())
    assert len(out.token_ids) == 4
