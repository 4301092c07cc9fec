"""The comparison with llama.cpp (measure/peers.py, peers_llama.py): the formulas on stand-ins for llama.cpp,
the course's side on the tiny model, and a clear message where llama.cpp is not installed."""
import math

import numpy as np
import pytest
import torch

from course_lib.measure import peers, peers_llama
from course_lib.runner import formats
from course_lib.runner.model import Model


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
    # where the compiled step's milliseconds go, at both thread counts, beside llama.cpp's own timer
    from course_lib.measure.compiled import PARTS
    assert sorted(p["threads"] for p in record["profile"]) == [1, 2]
    for p in record["profile"]:
        assert set(p["ms"]) == {"step", *PARTS} and p["read_floor_ms"] > 0
        assert p["ms"]["step"] == pytest.approx(sum(p["ms"][part] for part in PARTS))
    assert all(r["eval_ms_per_token"] > 0 for r in record["rows"] if r["path"] == "llama.cpp")
    assert {h["head"] for h in record["head"]} == {"float", "int8", "int8-dynamic", "int4"}


SYNTHETIC = {"rows": [{"path": "llama.cpp", "threads": 1, "decode_tokens_per_s": 100.0, "eval_ms_per_token": 9.0}],
             "profile": [{"path": "course int4 compiled", "threads": 1, "read_floor_ms": 6.0,
                          "read_bytes_per_s": 16e9, "bytes": {"weights": 96e6},
                          "ms": {"step": 11.0, "layer_products": 6.0, "head": 2.5, "attention": 0.7, "loop": 0.2,
                                 "rest": 1.6}}]}


def test_sitting_lines_give_each_sitting_its_ratio_per_thread_count():
    row = lambda path, t, dec: {"path": path, "threads": t, "decode_tokens_per_s": dec}  # noqa: E731
    lines = peers.sitting_lines({"a.json": {"rows": [row("course int4", 1, 60.0), row("course int4 compiled", 1, 80.0),
                                                     row("llama.cpp", 1, 100.0), row("course int4", 2, 90.0),
                                                     row("llama.cpp", 2, 60.0)]},
                                 "b.json": {"rows": [row("course int4", 1, 70.0)]}})  # no llama.cpp row: nothing
    assert lines[0] == ("  a.json: 1 thread(s) course int4 compiled  80.0 against 100.0 (0.80x); "
                        "2 thread(s) course int4  90.0 against  60.0 (1.50x)")
    assert lines[1] == "  b.json: "


def test_profile_lines_put_the_step_beside_llama_cpp():
    lines = peers.profile_lines(SYNTHETIC)
    assert lines[0].startswith("  1 thread(s), course int4 compiled step 11.00 ms = layer products 6.00 + head 2.50")
    assert "read floor 6.00 ms (96.0 MB at 16.0 GB/s)" in lines[0]
    assert lines[1].strip() == "llama.cpp 10.00 ms a token (its own timer: 9.00)"


def test_the_step_parts_figure_draws_what_the_record_holds():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.views import plots_perf
    ax = plots_perf.plot_step_parts(SYNTHETIC)
    bars = [(b.get_y(), b.get_x(), b.get_width()) for b in ax.patches if b.get_width() > 0]
    course = sorted((x, w) for y, x, w in bars if y < 0.5)  # the first bar: the compiled step's parts, stacked
    assert [round(w, 6) for _, w in course] == [6.0, 2.5, 0.7, 0.2, 1.6]
    assert course[-1][0] + course[-1][1] == pytest.approx(11.0)
    llama = sorted((x, w) for y, x, w in bars if y > 0.5)
    assert [round(w, 6) for _, w in llama] == [9.0, 1.0]  # its own timer, then the rest of its 10 ms gap
    floors = [line.get_xdata()[0] for line in ax.lines]
    assert floors == [6.0, 6.0]


@pytest.mark.slow
def test_step_parts_reads_the_models_own_bytes(tiny):
    from course_lib.measure.compiled import step_parts
    from course_lib.runner.static_step import compile_available
    if not compile_available()[0]:
        pytest.skip(compile_available()[1])
    ours = Model.from_transformers(tiny, dtype=torch.float32)
    p = step_parts(ours, [5, 6, 7, 8], n_new=6)
    assert p["bytes"]["weights"] == ours.weight_bytes()
    assert p["bytes"]["head"] == ours.lm_head.nbytes
    assert p["bytes"]["layer_products"] == sum(m.nbytes for m in ours.linears()[:-1])
    assert p["read_floor_ms"] == pytest.approx(1000 * ours.weight_bytes() / p["read_bytes_per_s"])
    assert all(p["ms"][part] > 0 for part in ("step", "layer_products", "attention", "loop"))


def test_head_options_read_fewer_bytes_with_fewer_bits(tiny, tokenizer):
    ours = Model.from_transformers(tiny, dtype=torch.float32)
    inputs = {"prompt": [5, 6, 7], "long": [], "text": list(range(3, 20)), "n_new": 3}
    rows = peers.head_options(ours, tokenizer, inputs)
    exact = formats.int8_dynamic_available()  # the int8 x int8 head only where its kernel is exact (not on AVX2 alone)
    assert [r["head"] for r in rows] == ["float", "int8"] + ["int8-dynamic"] * exact + ["int4"]
    sizes = {r["head"]: r["weight_bytes"] for r in rows}
    assert sizes["float"] > sizes.get("int8-dynamic", sizes["float"] - 1) > sizes["int8"] > sizes["int4"]
    # the tiny model's head is most of its bytes; the int8 x int8 head keeps two float32 numbers per row where the
    # weight-only one keeps one bfloat16
    assert all(r["decode_tokens_per_s"] > 0 and r["perplexity"] > 1 for r in rows)


def test_the_bare_loop_is_greedy_generation(tiny, tokenizer):
    from course_lib.measure.race import generate_exact
    ours = Model.from_transformers(tiny, dtype=torch.float32)
    assert peers.bare_decode(ours, [5, 6, 7], 6)["tokens"] == generate_exact(ours, tokenizer, [5, 6, 7], 6)
