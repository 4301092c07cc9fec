"""Interactive views: each wires a control to a compute function and a picture, nothing more.

What it does: builds ipywidgets that respond from data already computed or from fast pure functions
(tokenizing a line takes well under a millisecond), so moving a control never runs the model.
What it does not do: compute (the stage modules) or draw (plots.py); every view here has a static
fallback in plots.py for a rendered page.
"""
from __future__ import annotations

import time

import ipywidgets as W
import torch

from . import html_views
from ..engine.sampling import SamplingConfig, logits_to_probs, sample


def tokenizer_box(tokenizer, text: str = "Crème brûlée in 東京 costs 1,250 yen 🍮") -> W.VBox:
    """A text box; as you type, both tokenizations update below it with their counts."""
    box = W.Textarea(value=text, placeholder="Type anything", layout=W.Layout(width="100%", height="70px"),
                     continuous_update=True)
    out = W.HTML()

    def render(change=None):
        out.value = html_views.tokenizer_comparison(tokenizer, box.value)

    box.observe(render, names="value")
    render()
    return W.VBox([box, out])


class SamplingExplorer:
    """Sliders for temperature, top-k, top-p and min-p over logits computed ONCE by the model.
    Moving a slider only re-filters those logits (a few milliseconds); the model runs only when you
    press "generate". `last_update_ms` records how long the last redraw took."""

    def __init__(self, logits, labels: dict[int, str], generate_fn=None, show: int = 12, draws: int = 2000,
                 history=()):
        self.logits, self.labels, self.generate_fn, self.show, self.draws = logits, labels, generate_fn, show, draws
        self.history = list(history)  # the tokens so far: what the repetition penalty pushes down
        style = {"description_width": "90px"}
        self.temperature = W.FloatSlider(value=1.0, min=0.0, max=2.0, step=0.05, description="temperature", style=style)
        self.top_k = W.IntSlider(value=0, min=0, max=50, description="top-k (0=off)", style=style)
        self.top_p = W.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, description="top-p", style=style)
        self.min_p = W.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.01, description="min-p", style=style)
        self.penalty = W.FloatSlider(value=1.0, min=1.0, max=2.0, step=0.05, description="repetition", style=style)
        self.seed = W.IntText(value=0, description="seed", style=style, layout=W.Layout(width="180px"))
        self.draw_button = W.Button(description=f"draw {draws} samples")
        self.gen_button = W.Button(description="generate 3 continuations", disabled=generate_fn is None)
        self.bars, self.readout, self.text = W.HTML(), W.HTML(), W.Output()
        self.drawn = None
        self.last_update_ms = float("nan")
        for control in (self.temperature, self.top_k, self.top_p, self.min_p, self.penalty):
            control.observe(self.update, names="value")
        self.draw_button.on_click(self.draw)
        self.gen_button.on_click(self.generate)
        self.update()

    def config(self) -> SamplingConfig:
        return SamplingConfig(self.temperature.value, self.top_k.value, self.top_p.value, self.min_p.value,
                              self.penalty.value)

    def update(self, change=None):
        start = time.perf_counter()
        if change is not None:
            self.drawn = None  # old draws no longer match the setting
        self.bars.value, self.readout.value, self.ids = html_views.sampling_view(
            self.logits, self.labels, self.config(), self.show, self.history, self.drawn)
        self.last_update_ms = (time.perf_counter() - start) * 1000

    def draw(self, _=None):
        probs = logits_to_probs(self.logits, self.config(), self.history)  # on the logits' device
        generator = torch.Generator(device=probs.device).manual_seed(self.seed.value)  # note: a generator is per device
        tokens = sample(probs, generator, self.draws)
        counts = torch.bincount(tokens, minlength=self.logits.shape[-1]).float() / self.draws
        self.drawn = counts[self.ids].tolist()
        self.update()

    def generate(self, _=None):
        self.text.clear_output()
        with self.text:
            for i in range(3):
                print(f"[seed {self.seed.value + i}]", repr(self.generate_fn(self.config(), self.seed.value + i)))

    def widget(self) -> W.VBox:
        controls = W.HBox([W.VBox([self.temperature, self.top_k, self.penalty]), W.VBox([self.top_p, self.min_p])])
        return W.VBox([controls, self.readout, self.bars, W.HBox([self.seed, self.draw_button, self.gen_button]),
                       self.text])


class AttentionExplorer:
    """Layer and head sliders over attention weights computed ONCE (L, H, T, T); redraws in milliseconds."""

    def __init__(self, weights, tokens: list[str], groups: dict[int, list[int]] | None = None):
        self.weights, self.tokens = weights, tokens
        self.group_of = {h: g for g, heads in (groups or {}).items() for h in heads}
        L, H = weights.shape[:2]
        self.layer = W.IntSlider(value=0, min=0, max=L - 1, description="layer")
        self.head = W.IntSlider(value=0, min=0, max=H - 1, description="head")
        self.view = W.HTML()
        self.last_update_ms = float("nan")
        self.layer.observe(self.update, names="value")
        self.head.observe(self.update, names="value")
        self.update()

    def title(self) -> str:
        group = self.group_of.get(self.head.value)
        shared = f" (shares key/value head {group})" if group is not None else ""
        return f"layer {self.layer.value}, head {self.head.value}{shared}"

    def update(self, change=None):
        start = time.perf_counter()
        self.view.value = html_views.attention_table(self.weights[self.layer.value, self.head.value].tolist(),
                                                     self.tokens, self.title())
        self.last_update_ms = (time.perf_counter() - start) * 1000

    def widget(self) -> W.VBox:
        return W.VBox([W.HBox([self.layer, self.head]), self.view])


def block_size_explorer(rows: list[dict], bytes_per_token: float) -> W.VBox:
    """A block-size slider over paged.footprint rows computed once (one per block size): moving it only
    re-highlights the table."""
    slider = W.SelectionSlider(options=[r["block_size"] for r in rows], value=16 if any(r["block_size"] == 16 for r in rows)
                               else rows[0]["block_size"], description="block size")
    out = W.HTML()

    def render(change=None):
        out.value = html_views.footprint_table(rows, slider.value, bytes_per_token)

    slider.observe(render, names="value")
    render()
    return W.VBox([slider, out])
