"""The GPU path (CUDA, bfloat16): run whenever a CUDA GPU is available; skipped on CPU machines."""
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def gpu():
    import course_lib
    return course_lib.load_model(device="cuda", dtype="bfloat16", verbose=False)


def test_bfloat16_generation_on_the_gpu(gpu):
    from course_lib.text.context import chat_ids
    from course_lib.engine.generation import generate
    model, tokenizer = gpu
    result = generate(model, tokenizer, chat_ids(tokenizer, QUESTION, system="You are a helpful assistant."), 24)
    assert "Paris" in result.text and result.stop_reason == "end_of_turn"


def test_cached_against_uncached_within_bfloat16_tolerance(gpu):
    from course_lib.text.context import story_ids
    from course_lib.runner.forward import forward_logits
    from course_lib.engine.stages import decode_step, prefill
    model, tokenizer = gpu
    ids = story_ids(tokenizer)
    logits, cache = prefill(model, ids[:-1])
    step, _ = decode_step(model, [ids[-1]], cache)
    full = forward_logits(model, ids)[0, -1]
    assert step.device.type == "cuda" and int(step[0].argmax()) == int(full.argmax())
    assert (step[0] - full).abs().max() < 1.0  # bfloat16: measured about 0.56 on the CPU (lesson 07)


def test_our_model_and_its_cache_on_the_gpu(gpu):
    from course_lib.text.context import chat_ids
    from course_lib.engine.generation import generate
    from course_lib.runner.model import Model
    model, tokenizer = gpu
    ours = Model.from_transformers(model)
    ids = chat_ids(tokenizer, QUESTION, system="You are a helpful assistant.")
    assert ours.device.type == "cuda" and ours.dtype == torch.bfloat16
    assert generate(ours, tokenizer, ids, 16).text == generate(model, tokenizer, ids, 16).text


def test_the_server_answers_from_the_gpu(gpu):
    import openai
    from course_lib.serve.serving import free_port, start_server
    model, tokenizer = gpu
    handle = start_server(model, tokenizer, port=free_port(), max_tokens_cap=32)
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="local", timeout=60, max_retries=0)
        reply = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0,
                                               messages=[{"role": "user", "content": QUESTION}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        handle.stop()


def test_the_paged_cache_on_the_gpu(gpu):
    from course_lib.engine.request import Job
    from course_lib.engine.generation import run_paged
    from course_lib.text.context import chat_ids
    from course_lib.engine.generation import generate
    from course_lib.runner.model import Model
    from course_lib.runner.paged import BlockPool
    model, tokenizer = gpu
    ours = Model.from_transformers(model)
    prompts = [chat_ids(tokenizer, q) for q in (QUESTION, "Name three colours.", "Why is the sky blue?")]
    jobs = [Job(f"r{i}", p, 24, frozenset({2})) for i, p in enumerate(prompts)]
    pool = BlockPool.for_model(ours, 64)
    assert pool.keys[0].device.type == "cuda"
    run_paged(ours, jobs, pool)
    for job, p in zip(jobs, prompts):  # bfloat16: a near-tie may flip between batched and alone; compare the start
        alone = generate(ours, tokenizer, p, 24, stop_ids={2}).token_ids
        assert job.tokens[:4] == alone[:4]
    assert pool.manager.num_used == 0


def test_lesson_16_kernels_on_the_gpu():
    """Tiled attention and the paged decode run on CUDA as on the CPU (the same torch code) and meet their references."""
    import torch.nn.functional as F
    from course_lib.runner.attention_kernels import decode_plan, gather_decode, paged_decode, tiled_attention
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, 300, 64, device="cuda", generator=g) for h in (9, 3, 3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (tiled_attention(q, k, v, tile_q=64, tile_k=64) - ref).abs().max() <= 1e-4
    keys, values = (torch.randn(64 * 16, 3, 64, device="cuda", generator=g) for _ in range(2))
    tables = torch.randperm(64, device="cuda", generator=g)[:40].view(2, 20)
    lengths = torch.tensor([317, 150], device="cuda")
    read = torch.stack([torch.cat([torch.full((320 - n,), int(t[0]) * 16, device="cuda"),
                                   (t[:, None] * 16 + torch.arange(16, device="cuda")).flatten()[:n]])
                        for t, n in zip(tables, lengths.tolist())])
    qd = torch.randn(2, 9, 64, device="cuda", generator=g)
    out = paged_decode(qd, keys, values, decode_plan(tables, lengths, 16, 128, 2), 16)
    assert (out - gather_decode(qd, keys, values, read, lengths)).abs().max() <= 1e-4


NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_lesson_runs_on_the_gpu(path, monkeypatch):
    """Each lesson top to bottom with COURSE_DEVICE=cuda: where a lesson's kernels exist only on the CPU it says so
    and runs there (runtime.cpu_lesson); everywhere else it must run on the GPU without an error."""
    import nbformat
    from nbclient import NotebookClient
    monkeypatch.setenv("COURSE_DEVICE", "cuda")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="llm-course", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0]["ename"] + ": " + errors[0]["evalue"]
