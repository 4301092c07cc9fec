"""Checks for 03_forward_pass: count parameters, entropy in bits, read the logit lens, project a layer by hand,
and a forward pass's time predicted before it is measured."""
from __future__ import annotations

import math

import torch

from ..inside.anatomy import layer_outputs, logit_lens
from ..runner.forward import forward_logits
from ..runtime import time_it
from . import check_prediction, fresh, safely, verdict

# texts whose next word first tops the logit lens at different depths (checked when a task is drawn)
LENS_TASKS = [("A, B, C, D,", " E"), ("The opposite of hot is", " cold"), ("Once upon a", " time"),
              ("The United States of", " America"), ("to be or not to", " be"), ("Thank you very", " much")]


def check_count_params(count_params, model) -> bool:
    """count_params(module) -> number of parameters (elements of every weight) in a torch module."""
    for name, module in [("embedding", model.model.embed_tokens), ("block 0", model.model.layers[0]),
                         ("final norm", model.model.norm)]:
        ok, got = safely(count_params, module)
        if not ok:
            return verdict(False, "", got)
        want = sum(p.numel() for p in module.parameters())
        if got != want:
            return verdict(False, "", f"{name}: you counted {got!r}, it has {want:,}. Hint: p.numel() for p in module.parameters()")
    return verdict(True, "you can now size any part of a model", "")


def check_entropy(entropy_bits) -> bool:
    """entropy_bits(probs) -> Shannon entropy in bits of a probability vector (zeros allowed)."""
    cases = [torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0, 0.0]), torch.full((8,), 1 / 8), torch.tensor([0.7, 0.2, 0.1])]
    for probs in cases:
        ok, got = safely(entropy_bits, probs.clone())
        if not ok:
            return verdict(False, "", got)
        p = probs[probs > 0]
        want = float(-(p * p.log2()).sum())
        number = float(got) if isinstance(got, (float, int)) or (torch.is_tensor(got) and got.numel() == 1) else math.nan
        if math.isnan(number) or abs(number - want) > 1e-5:
            return verdict(False, "", f"for {probs.tolist()} you returned {got!r}, expected {want:.4f} bits. "
                           "Hint: -(p * log2 p) summed over p > 0 (0 log 0 counts as 0)")
    return verdict(True, "1 bit is a coin flip; 3 bits is eight equal choices", "")


def _first_hit(model, tokenizer, text: str, word: str):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    top, _ = logit_lens(model, ids)  # (L+1, T, 1)
    target = tokenizer(word, add_special_tokens=False)["input_ids"][0]
    hits = [row - 1 for row in range(1, top.shape[0]) if int(top[row, -1, 0]) == target]
    return hits[0] if hits else None


def first_layer_task(model, tokenizer) -> dict:
    """A text and the word that follows it, drawn at random (not the lesson's own example), for exercise 3.
    Prints the task; pass the returned dict to check_first_layer as **task."""
    rng = fresh()
    tasks = [(t, w) for t, w in LENS_TASKS if _first_hit(model, tokenizer, t, w) is not None]
    text, word = rng.choice(tasks)
    print(f"your text: {text!r}; the word: {word!r}")
    return {"text": text, "word": word}


def check_first_layer(answer, model, tokenizer, text: str, word: str) -> bool:
    """answer: the first layer (0-29) after which the logit lens's top guess at the last position of `text` is
    `word`."""
    want = _first_hit(model, tokenizer, text, word)
    return verdict(answer == want, f"{word!r} first tops the lens after layer {want}",
                   f"you said {answer!r}. Run logit_lens on your text and look at the LAST position, row by row "
                   "(row 0 is the embedding, row i + 1 is after layer i)")


def check_project(project, model, tokenizer) -> bool:
    """project(hidden) -> top next-token ID from a (hidden,) residual vector: final norm, then output head."""
    ids = tokenizer("What is the capital of France?", add_special_tokens=False)["input_ids"]
    hidden = layer_outputs(model, ids)  # (L+1, T, hidden)
    for layer in (5, 15, 30):
        vec = hidden[layer, -1]
        ok, got = safely(project, vec.clone())
        if not ok:
            return verdict(False, "", got)
        with torch.inference_mode():
            want = int(model.lm_head(model.model.norm(vec)).argmax())
        if got != want:
            return verdict(False, "", f"for the state after row {layer} you returned {got!r}, expected {want}. "
                           "Hint: int(model.lm_head(model.model.norm(hidden)).argmax())")
    return verdict(True, "that projection is the whole logit lens", "")


def check_pass_prediction(prediction_ms, model, ids: list[int], n: int = 64, tolerance: float = 1.6) -> bool:
    """prediction_ms: your prediction, written BEFORE this runs, of the milliseconds of ONE forward pass over an
    n-token sequence (section 7 printed a 1-token pass and a many-token pass). The check measures it (best of 3)."""
    tokens = (list(ids) * (n // max(len(ids), 1) + 1))[:n]
    return check_prediction(prediction_ms, lambda: time_it(lambda: forward_logits(model, tokens), model.device,
                                                           repeats=3).best * 1000,
                            unit="ms", what=f"for one pass over {n} tokens", tolerance=tolerance,
                            timed=True, hint="One pass reads each weight once for all its tokens, so it is not n times a 1-token "
                                 "pass; section 7's many-token rate (GFLOP/s) is the better guide")
