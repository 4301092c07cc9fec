"""Pictures of data the other modules computed. Every plot_* takes data (and ax=None), returns the Axes.

What it does: draws with matplotlib only; no model calls, no widgets, so each works headless and in
a rendered page. What it does not do: compute anything worth testing on its own.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from .html_views import PALETTE, ROLE_COLOURS, token_label


def axes_or_new(ax, size=(7, 3.5)):
    """The Axes to draw on: the one given, or a new figure's."""
    if ax is None:
        _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def spread_bars(ax, xs, ys, lows, highs, color, horizontal: bool = False) -> None:
    """A bar through each measured point from its fastest to its slowest repeat (lows, highs), so a noisy run
    looks noisy. horizontal: the measurements run along x (bar charts drawn with barh)."""
    below = [y - lo for y, lo in zip(ys, lows)]
    above = [hi - y for y, hi in zip(ys, highs)]
    if horizontal:
        ax.errorbar(ys, xs, xerr=[below, above], fmt="none", ecolor=color, capsize=3, alpha=0.7)
    else:
        ax.errorbar(xs, ys, yerr=[below, above], fmt="none", ecolor=color, capsize=3, alpha=0.7)


def one_legend(fig, axes) -> None:
    """Panels that share their series get one legend above them all, instead of one per panel (or none)."""
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes:
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    fig.legend(handles, labels, loc="outside upper center", ncols=len(labels), fontsize=9, frameon=False)


def plot_step_times(labels: list[str], seconds: list[float], ax=None, title: str = "Where the time went"):
    """Horizontal bars, one per pipeline step, in milliseconds, with the value written on each bar."""
    ax = axes_or_new(ax, (7, 0.45 * len(labels) + 1))
    ms = [s * 1000 for s in seconds]
    bars = ax.barh(labels, ms, color=[PALETTE[i % len(PALETTE)] for i in range(len(labels))])
    ax.invert_yaxis()
    ax.bar_label(bars, labels=[f"{m:.1f} ms" for m in ms], padding=3, fontsize=8)
    ax.set_xlabel("milliseconds (measured in this run)")
    ax.set_xlim(0, max(ms) * 1.25 if ms else 1)
    ax.set_title(title)
    return ax


def plot_top_candidates(texts: list[str], probs: list[float], ax=None, highlight: str | None = None,
                        title: str = "Next-token probabilities"):
    """Bar chart of the top candidates; token text shown with visible spaces; `highlight` in a second colour."""
    ax = axes_or_new(ax)
    shown = [token_label(t) for t in texts]
    colours = [PALETTE[1] if highlight is not None and t.strip() == highlight else PALETTE[0] for t in texts]
    bars = ax.bar(range(len(probs)), probs, color=colours)
    ax.set_xticks(range(len(probs)), shown, rotation=45, ha="right")
    ax.bar_label(bars, labels=[f"{p:.2f}" for p in probs], fontsize=7)
    ax.set_ylabel("probability")
    ax.set_ylim(0, min(1.0, max(probs) * 1.2) if probs else 1)
    ax.set_title(title)
    return ax


def plot_token_probs(texts: list[str], probs: list[float], ax=None, title: str = "Probability of each chosen token"):
    """One bar per generated token: how sure the model was when it picked it."""
    ax = axes_or_new(ax)
    shown = [token_label(t) for t in texts]
    ax.bar(range(len(probs)), probs, color=PALETTE[2])
    ax.set_xticks(range(len(probs)), shown, rotation=45, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("probability when chosen")
    ax.set_title(title)
    return ax


def plot_length_histogram(lengths: dict[str, list[int]], ax=None, max_len: int = 16):
    """Histogram of vocabulary piece lengths in bytes, one series per tokenizer (share of each vocabulary)."""
    ax = axes_or_new(ax)
    bins = list(range(1, max_len + 2))
    for i, (name, values) in enumerate(lengths.items()):
        clipped = [min(v, max_len) for v in values]
        ax.hist(clipped, bins=bins, alpha=0.55, label=f"{name} ({len(values):,} pieces)", color=PALETTE[i],
                weights=[1 / len(values)] * len(values), align="left")
    ax.set_xlabel(f"piece length in bytes ({max_len} means {max_len} or more)")
    ax.set_ylabel("share of the vocabulary")
    ax.legend()
    ax.set_title("How long are the pieces in each vocabulary?")
    return ax


def plot_chars_per_token(names: list[str], model: list[float], cl100k: list[float], ax=None):
    """Grouped bars: characters per token for each text, both tokenizers (higher means cheaper)."""
    ax = axes_or_new(ax)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], model, width=0.4, label="SmolLM2", color=PALETTE[0])
    ax.bar([x + 0.2 for x in xs], cl100k, width=0.4, label="cl100k_base", color=PALETTE[1])
    ax.set_xticks(list(xs), names, rotation=20, ha="right")
    ax.set_ylabel("characters per token")
    ax.legend()
    ax.set_title("Characters per token, per tokenizer")
    return ax


def plot_context_parts(parts: list[tuple[str, int]], budget: int | None = None, ax=None,
                       title: str = "Tokens per part of the context"):
    """One stacked horizontal bar: each part of the context in its role's colour; a budget line if given."""
    ax = axes_or_new(ax, (8, 1.8))
    left, seen = 0, set()
    for label, n in parts:
        ax.barh([0], [n], left=left, color=ROLE_COLOURS.get(label, PALETTE[7]), edgecolor="white",
                label=None if label in seen else label)
        if n >= 8:
            ax.text(left + n / 2, 0, str(n), ha="center", va="center", fontsize=7, color="white")
        seen.add(label)
        left += n
    if budget is not None:
        ax.axvline(budget, color="black", linestyle="--", linewidth=1.5)
        ax.text(budget, 0.45, f" budget {budget}", fontsize=8, va="bottom")
    ax.set_yticks([])
    ax.set_xlabel("tokens")
    ax.set_xlim(0, max(left, budget or 0) * 1.05)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=5, fontsize=8, frameon=False)
    ax.set_title(title)
    return ax


def plot_kept_messages(roles: list[str], kept: dict[str, list[int]], ax=None,
                       title: str = "Which messages each strategy keeps"):
    """Grid: one row per strategy, one column per message; filled = kept, pale = dropped."""
    ax = axes_or_new(ax, (8, 0.6 * len(kept) + 1.2))
    for row, (strategy, indices) in enumerate(kept.items()):
        for col, role in enumerate(roles):
            on = col in indices
            ax.add_patch(plt.Rectangle((col, row), 0.9, 0.8, color=ROLE_COLOURS.get(role, PALETTE[7]),
                                       alpha=1.0 if on else 0.15))
            ax.text(col + 0.45, row + 0.4, role[0].upper() if on else "×", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(roles))
    ax.set_ylim(0, len(kept))
    ax.set_yticks([r + 0.4 for r in range(len(kept))], list(kept))
    ax.set_xticks([c + 0.45 for c in range(len(roles))], [str(c) for c in range(len(roles))])
    ax.set_xlabel("message index (S system, U user, A assistant; × dropped)")
    ax.invert_yaxis()
    ax.set_title(title)
    return ax


def plot_reshaped(labels: list[str], before: list[float], after: list[float], ax=None,
                  drawn: list[float] | None = None, title: str = "Before and after sampling settings"):
    """Static fallback of the sampling explorer: paired bars, kept set in colour, draws as orange dots."""
    ax = axes_or_new(ax)
    xs = range(len(labels))
    shown = [token_label(t) for t in labels]
    ax.bar([x - 0.2 for x in xs], before, width=0.4, color="#bbb", label="before (T=1, no filter)")
    ax.bar([x + 0.2 for x in xs], after, width=0.4, color=[PALETTE[0] if a > 0 else "#eee" for a in after],
           label="after this setting")
    if drawn is not None:
        ax.plot([x + 0.2 for x in xs], drawn, "o", color=PALETTE[1], label="share of draws")
    ax.set_xticks(list(xs), shown, rotation=45, ha="right")
    ax.set_ylabel("probability")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return ax


def plot_token_timeline(at_seconds: list[float], ax=None, title: str = "When each token arrived"):
    """Arrival time of each new token: the first one waits for prefill (TTFT), the rest are decode steps."""
    ax = axes_or_new(ax)
    ms = [a * 1000 for a in at_seconds]
    ax.plot(range(len(ms)), ms, "o-", color=PALETTE[0], markersize=3)
    if ms:
        ax.annotate(f"time to first token\n{ms[0]:.0f} ms", (0, ms[0]), xytext=(len(ms) * 0.15, ms[-1] * 0.6),
                    arrowprops={"arrowstyle": "->"}, fontsize=8)
    ax.set_xlabel("new token index")
    ax.set_ylabel("ms since the request")
    ax.set_title(title)
    return ax


def plot_gaps(gaps_seconds: list[float], ax=None, title: str = "Inter-token latency"):
    """Histogram of the gaps between consecutive tokens, in milliseconds."""
    ax = axes_or_new(ax)
    ax.hist([g * 1000 for g in gaps_seconds], bins=30, color=PALETTE[2])
    ax.set_xlabel("ms between consecutive tokens")
    ax.set_ylabel("count")
    ax.set_title(title)
    return ax


def plot_xy(xs, ys, xlabel: str, ylabel: str, ax=None, title: str = "", fit_line: bool = False, label=None,
            spread=None):
    """A measured curve with markers; optionally a least-squares line through it. The y axis starts at 0 for
    positive data, so a rise of a few percent is not drawn across the whole panel.
    spread: (lowest, highest) of the repeated measurements behind each point, drawn as a bar, so a noisy run
    looks noisy."""
    ax = axes_or_new(ax)
    line, = ax.plot(xs, ys, "o-", markersize=4, label=label)
    if spread is not None:
        spread_bars(ax, xs, ys, [lo for lo, _ in spread], [hi for _, hi in spread], line.get_color())
    top = max([hi for _, hi in spread] if spread is not None else ys)
    if min(ys) >= 0:
        ax.set_ylim(0, top * 1.1 or 1)
    if fit_line and len(xs) > 1:
        import numpy as np
        slope, intercept = np.polyfit(xs, ys, 1)
        ax.plot(xs, [slope * x + intercept for x in xs], "--", color="grey", label=f"fit: {slope:.3g} per unit")
        ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return ax


def plot_attention(weights, tokens: list[str], ax=None, title: str = "Attention", colorbar: bool = True):
    """Heatmap of one head: rows = the token looking (query), columns = the token looked at (key).
    The grey upper triangle is the causal mask: a token cannot look ahead."""
    import numpy as np
    ax = axes_or_new(ax, (5.5, 5))
    w = np.array(weights, dtype=float)
    masked = np.ma.masked_where(np.triu(np.ones_like(w, dtype=bool), 1), w)
    image = ax.imshow(masked, cmap="Blues", vmin=0, vmax=1)
    ax.set_facecolor("#e8e8e8")  # masked cells (the future) show as grey background
    labels = [token_label(t) for t in tokens]
    ax.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=8)
    ax.set_yticks(range(len(tokens)), labels, fontsize=8)
    ax.set_xlabel("attended to (key)")
    ax.set_ylabel("looking (query)")
    ax.set_title(title, fontsize=10)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return ax


def plot_head_grid(layer_weights, tokens: list[str], layer: int, groups: dict[int, list[int]] | None = None):
    """All heads of one layer as thumbnails; heads that share a key/value head get the same title colour."""
    n = len(layer_weights)
    cols = 3 if n % 3 == 0 else 4
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(3.2 * cols, 3.0 * ((n + cols - 1) // cols)),
                             layout="constrained", squeeze=False)
    colour_of = {h: PALETTE[g] for g, heads in (groups or {}).items() for h in heads}
    for h, ax in enumerate(axes.flat):
        if h >= n:
            ax.axis("off")
            continue
        plot_attention(layer_weights[h], tokens, ax=ax, title=f"layer {layer}, head {h}", colorbar=False)
        ax.title.set_color(colour_of.get(h, "black"))
        ax.set_xlabel("")
        ax.set_ylabel("")
    return axes


def plot_logit_lens(top_tokens: list[list[str]], top_probs, position_labels: list[str], ax=None,
                    title: str = "Logit lens: the top next-token guess after each layer"):
    """Layers (rows) by positions (columns); colour = probability of the top guess, text = the guess."""
    import numpy as np
    probs = np.array(top_probs, dtype=float)
    ax = axes_or_new(ax, (1.3 * len(position_labels) + 2, 0.28 * len(top_tokens) + 1.5))
    image = ax.imshow(probs, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.figure.colorbar(image, ax=ax, fraction=0.03, pad=0.02, label="probability of the top guess")
    for r, row in enumerate(top_tokens):
        for c, text in enumerate(row):
            ax.text(c, r, token_label(text)[:9], ha="center", va="center", fontsize=7,
                    color="white" if probs[r, c] < 0.6 else "black")
    ax.set_xticks(range(len(position_labels)), [token_label(t) for t in position_labels], rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(top_tokens)), ["emb"] + [str(i) for i in range(len(top_tokens) - 1)], fontsize=7)
    ax.set_ylabel("after layer")
    ax.set_xlabel("input position (the guess is for the NEXT token)")
    ax.set_title(title)
    return ax


def plot_parameter_map(parts: list[tuple[str, int]], ax=None, title: str = "Where the parameters are"):
    """Horizontal bars of parameter counts per part, in millions."""
    ax = axes_or_new(ax, (7, 2.6))
    names = [p for p, _ in parts]
    millions = [n / 1e6 for _, n in parts]
    bars = ax.barh(names, millions, color=PALETTE[: len(parts)])
    ax.invert_yaxis()
    ax.bar_label(bars, labels=[f"{m:.1f} M" for m in millions], padding=3, fontsize=8)
    ax.set_xlabel("millions of parameters")
    ax.set_xlim(0, max(millions) * 1.25)
    ax.set_title(title)
    return ax


def plot_layer_head_map(scores, ax=None, title: str = "", label: str = "", diverging: bool = True):
    """An (L, H) table as a heatmap: one row per layer (0 at the top), one column per head. diverging: a colour
    scale centred on 0 (red and blue for the two signs), for effects that can go either way."""
    import numpy as np
    ax = axes_or_new(ax, (4, 6))
    s = np.array(scores, dtype=float)
    limit = float(np.abs(s).max()) or 1.0
    image = ax.imshow(s, cmap="RdBu" if diverging else "Blues", vmin=-limit if diverging else 0, vmax=limit,
                      aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(s.shape[1]))
    ax.set_title(title, fontsize=10)
    ax.figure.colorbar(image, ax=ax, fraction=0.08, pad=0.04, label=label)
    return ax


def plot_patching(recovered, tokens: list[str], ax=None, title: str = "Where the answer's information is"):
    """(L + 1, P) fractions recovered by patching the residual stream at (layer, position): rows are the inputs of
    blocks 0..L-1 and, last, the output of the final block; columns are the patched positions (tokens)."""
    import numpy as np
    ax = axes_or_new(ax, (6, 6))
    r = np.array(recovered, dtype=float)
    image = ax.imshow(r, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    ax.set_xticks(range(len(tokens)), [token_label(t) for t in tokens], rotation=90, fontsize=8)
    ax.set_yticks(range(0, r.shape[0], 5), [f"block {i} in" if i < r.shape[0] - 1 else "last out"
                                              for i in range(0, r.shape[0], 5)], fontsize=8)
    ax.set_xlabel("patched position")
    ax.set_ylabel("residual stream at")
    ax.set_title(title, fontsize=10)
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of the clean answer recovered")
    return ax
