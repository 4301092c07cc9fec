"""Interactive views: each wires a control to a compute function and a picture, nothing more.

What it does: builds ipywidgets that respond from data already computed or from fast pure functions
(tokenizing a line takes well under a millisecond), so moving a control never runs the model.
What it does not do: compute (the stage modules) or draw (plots.py); every view here has a static
fallback in plots.py for a rendered page.
"""
from __future__ import annotations

import ipywidgets as W

from . import html_views
from .tokenization import cl100k_tokens, model_tokens


def tokenizer_box(tokenizer, text: str = "Crème brûlée in 東京 costs 1,250 yen 🍮") -> W.VBox:
    """A text box; as you type, both tokenizations update below it with their counts."""
    box = W.Textarea(value=text, placeholder="Type anything", layout=W.Layout(width="100%", height="70px"),
                     continuous_update=True)
    out = W.HTML()

    def render(change=None):
        out.value = html_views.compare(model_tokens(tokenizer, box.value), cl100k_tokens(box.value))

    box.observe(render, names="value")
    render()
    return W.VBox([box, out])
