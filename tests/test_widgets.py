"""Widgets respond to their controls from cached data (no model call), and show what changed."""
import torch

from course_lib.runner.forward import forward_logits
from course_lib.views.widgets import SamplingExplorer, tokenizer_box

from conftest import chat_ids


def test_tokenizer_box_updates_chips(tokenizer):
    box = tokenizer_box(tokenizer, "Paris")
    area, out = box.children
    before = out.value
    area.value = "Unbelievable 👍"
    assert out.value != before and "3706" in out.value and "SmolLM2 tokenizer: 6 tokens" in out.value


def test_sampling_explorer_reacts_without_the_model(model, tokenizer, monkeypatch):
    logits = forward_logits(model, chat_ids(tokenizer, "What is the capital of France?"))[0, -1]
    labels = {i: tokenizer.decode([i]) for i in torch.topk(logits, 40).indices.tolist()}
    explorer = SamplingExplorer(logits, labels)
    monkeypatch.setattr(model, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model called")))
    start_bars, start_text = explorer.bars.value, explorer.readout.value
    explorer.temperature.value = 0.0
    assert "kept tokens:</b> 1 of" in explorer.readout.value and explorer.bars.value != start_bars
    explorer.temperature.value = 1.0
    explorer.top_p.value = 0.5
    assert explorer.readout.value != start_text and explorer.last_update_ms < 1000
    explorer.draw()
    assert explorer.drawn is not None and abs(sum(explorer.drawn) - 1) < 0.2
    assert "orange" in explorer.bars.value


def test_attention_explorer_changes_view(tokenizer):
    from course_lib.views.widgets import AttentionExplorer
    weights = torch.rand(4, 3, 5, 5).tril()
    weights = weights / weights.sum(-1, keepdim=True)
    explorer = AttentionExplorer(weights, list("abcde"), {0: [0, 1, 2]})
    first = explorer.view.value
    explorer.layer.value = 3
    assert explorer.view.value != first and "layer 3, head 0" in explorer.view.value
    explorer.head.value = 2
    assert "layer 3, head 2 (shares key/value head 0)" in explorer.view.value


def test_block_size_explorer_highlights_the_chosen_row():
    from course_lib.runner import paged
    from course_lib.views.widgets import block_size_explorer
    rows = [paged.footprint([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], b) for b in (1, 2, 4)]
    box = block_size_explorer(rows, bytes_per_token=100.0)
    slider, view = box.children
    assert slider.value == 1 and view.value.count("<tr") == 4
    before = view.value
    slider.value = 4
    assert view.value != before and "font-weight:bold'><td style='padding:2px 8px;text-align:right'>4<" in view.value
