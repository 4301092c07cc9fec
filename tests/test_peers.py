"""The comparison with llama.cpp (measure/peers.py, peers_llama.py): the formulas on stand-ins for llama.cpp,
the course's side on the tiny model, and a clear message where llama.cpp is not installed."""
import math

import numpy as np
import pytest
import torch

from course_lib.measure import peers, peers_llama
from course_lib.model import Model


class FakeLlama:
    """What llama_decode and llama_perplexity read from llama_cpp.Llama: reset, eval, n_tokens, scores."""

    def __init__(self, vocab=5, next_of=lambda t: (t + 1) % 5, uniform=False):
        self.vocab, self.next_of, self.uniform = vocab, next_of, uniform
        self.scores, self.n_tokens = np.zeros((64, vocab), dtype=np.float32), 0

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        for t in tokens:
            row = np.zeros(self.vocab, dtype=np.float32)
            if not self.uniform:
                row[self.next_of(t)] = 5.0
            self.scores[self.n_tokens] = row
            self.n_tokens += 1


def test_llama_decode_is_greedy_on_the_last_logits(monkeypatch):
    monkeypatch.setattr(peers_llama, "last_logits", lambda llm: llm.scores[llm.n_tokens - 1])
    out = peers_llama.llama_decode(FakeLlama(), [0, 1, 2], n_new=6)
    assert out["tokens"] == [3, 4, 0, 1, 2, 3] and out["tokens_per_s"] > 0


def test_llama_perplexity_of_uniform_logits_is_the_vocabulary():
    assert peers_llama.llama_perplexity(FakeLlama(vocab=7, uniform=True), [1, 2, 3, 4]) == pytest.approx(7)
    sure = peers_llama.llama_perplexity(FakeLlama(), [0, 1, 2, 3])  # every next token given logit 5 over 4 zeros
    assert sure == pytest.approx(math.exp(-math.log(math.exp(5) / (math.exp(5) + 4))), rel=1e-6)
    wrong = peers_llama.llama_perplexity(FakeLlama(), [0, 3, 1, 4])  # never the predicted one
    assert wrong > sure


def test_llama_side_without_llama_cpp_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    with pytest.raises(ImportError, match="pip install llama-cpp-python"):
        peers.llama_side("model.gguf", 1, {"prompt": [1], "long": [1], "text": [1, 2], "n_new": 1})


def test_the_course_side_measures_each_figure(tiny, tokenizer):
    from course_lib.measure.quality import perplexity
    ours = Model.from_transformers(tiny, dtype=torch.float32)
    inputs = {"prompt": [5, 6, 7], "long": list(range(3, 40)), "text": list(range(3, 30)), "n_new": 4}
    row = peers.course_path(ours, tokenizer, inputs)
    assert row["decode_tokens_per_s"] > 0 and row["generate_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
    assert row["perplexity"] == pytest.approx(perplexity(ours, inputs["text"])) and row["perplexity"] > 1


def test_step_anatomy_adds_up(tiny):
    from course_lib.measure.race import step_anatomy
    ours = Model.from_transformers(tiny, dtype=torch.float32)
    a = step_anatomy(ours, [5, 6, 7, 8], steps=5)
    assert a["rest_ms"] == pytest.approx(a["step_ms"] - a["products_ms"])
    assert 0 < a["products_ms"] and 0 < a["python_calls"] < a["aten_ops"]
    assert a["calling_ms_estimate"] == pytest.approx(a["python_calls"] * a["tiny_call_us"] / 1000)


def test_describe_compares_each_thread_count_with_llama_cpp():
    row = lambda path, t, dec, pre, ppl: {"path": path, "threads": t, "decode_tokens_per_s": dec,  # noqa: E731
                                          "prefill_tokens_per_s": pre, "perplexity": ppl}
    record = {"inputs": {"prompt_tokens": 29, "new_tokens": 128, "prefill_tokens": 1000, "perplexity_tokens": 1024},
              "rows": [row("course int4", 1, 60.0, 300.0, 18.18), row("course float32", 1, 20.0, 500.0, 18.0),
                       row("llama.cpp", 1, 50.0, 250.0, 18.0)]}
    lines = peers.describe(record)
    assert "fastest decode course int4 at 1.20x llama.cpp (perplexity +1.0%)" in lines[-2]
    assert "fastest prefill course float32 at 2.0x" in lines[-2]


def test_the_committed_record_holds_what_the_issue_asks():
    import json
    from pathlib import Path
    records = sorted((Path(__file__).resolve().parent.parent / "data" / "benchmarks").glob("peers-cpu-*.json"))
    assert records, "no committed peers-cpu record"
    record = json.loads(records[-1].read_text())
    for t in (1, 2):
        paths = {r["path"] for r in record["rows"] if r["threads"] == t}
        assert "llama.cpp" in paths and "course int4" in paths and "course float32" in paths
    assert record["inputs"]["prefill_tokens"] == 1000 and record["llama_cpp_build"]
    assert all(r["perplexity"] > 1 and r["decode_tokens_per_s"] > 0 for r in record["rows"])
    compiled = [r for r in record["rows"] if r["path"] == "course int4 compiled"]  # the compiled step, at 1 and 2
    assert sorted(r["threads"] for r in compiled) == [1, 2] and all(r["compile_s"] > 0 for r in compiled)


def test_head_options_read_fewer_bytes_with_fewer_bits(tiny, tokenizer):
    ours = Model.from_transformers(tiny, dtype=torch.float32)
    inputs = {"prompt": [5, 6, 7], "long": [], "text": list(range(3, 20)), "n_new": 3}
    rows = peers.head_options(ours, tokenizer, inputs)
    assert [r["head"] for r in rows] == ["float", "int8", "int4"]
    sizes = [r["weight_bytes"] for r in rows]
    assert sizes[0] > sizes[1] > sizes[2]  # the tiny model's head is most of its bytes
    assert all(r["decode_tokens_per_s"] > 0 and r["perplexity"] > 1 for r in rows)


def test_the_bare_loop_is_greedy_generation(tiny, tokenizer):
    from course_lib.measure.race import generate_exact
    ours = Model.from_transformers(tiny, dtype=torch.float32)
    assert peers.bare_decode(ours, [5, 6, 7], 6)["tokens"] == generate_exact(ours, tokenizer, [5, 6, 7], 6)
