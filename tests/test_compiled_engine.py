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
    runner = CompiledRunner(small)
    prompt = tokenizer.encode("Compiled inside the engine")
    want = generate(small, tokenizer, prompt, 8, stop_ids=())
    got = generate(runner, tokenizer, prompt, 8, stop_ids=())
    assert got.token_ids == want.token_ids  # float32: the fused kernels add in another order, no near-tie here
    assert runner.steps[(1, 256, torch.get_num_threads())].compile_seconds > 0
