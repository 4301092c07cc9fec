"""Self-contained HTML views: tokens as coloured chips, a chat context with its roles coloured.

What it does: returns HTML strings with inline styles only (no script, no CDN), so they render in
JupyterLab, in a static HTML page, and offline. What it does not do: compute tokens (tokenization.py,
context.py) or anything interactive (widgets.py).
"""
from __future__ import annotations

import html

CHIP_COLOURS = ["#FDE2C2", "#C9E4F6", "#D5EFC8", "#F6CFE0", "#E3D7F3", "#FFF1B8", "#CDEDEA"]


def _visible(text: str) -> str:
    """Make whitespace visible: space -> ␣, newline -> ↵, tab -> →."""
    return html.escape(text.replace(" ", "␣").replace("\n", "↵").replace("\t", "→"))


MAX_CHIPS = 2000  # a pasted book stays responsive: at most this many chips, then a count of the rest


def token_chips(tokens, title: str = "", limit: int = MAX_CHIPS, total: int | None = None) -> str:
    """One coloured chip per token with its ID underneath; special tokens dark, byte fragments dashed.
    At most `limit` chips are drawn, then a line "… N more tokens"; `total`: the whole text's token count
    when only the first tokens were passed in."""
    chips = []
    for n, tok in enumerate(tokens[:limit]):
        if tok.special:
            style = "background:#333;color:#fff"
        else:
            style = f"background:{CHIP_COLOURS[n % len(CHIP_COLOURS)]};color:#111"
        border = "1px dashed #C44E52" if not tok.complete else "1px solid #0002"
        chips.append(
            f'<span title="token ID {tok.id}" style="display:inline-flex;flex-direction:column;align-items:center;'
            f'margin:2px;padding:1px 4px;border-radius:4px;border:{border};{style};font-family:monospace">'
            f'<span style="white-space:pre">{_visible(tok.text) if tok.complete else html.escape(tok.text)}</span>'
            f'<span style="font-size:9px;opacity:.7">{tok.id}</span></span>')
    total = len(tokens) if total is None else total
    if total > min(limit, len(tokens)):
        chips.append(f'<div style="opacity:.7;font-style:italic">… {total - min(limit, len(tokens)):,} more tokens '
                     f'(only the first {limit:,} are drawn)</div>')
    head = f'<div style="font-weight:bold;margin-top:6px">{_visible(title).replace("␣", " ")}</div>' if title else ""
    return f'{head}<div style="line-height:2.2">{"".join(chips)}</div>'


def compare(model_tokens, cl100k_tokens, model_name: str = "SmolLM2 tokenizer", totals: tuple[int, int] | None = None) -> str:
    """Both tokenizations of one text, one above the other, with their counts (totals: the whole text's counts
    when only the first tokens of each were passed in)."""
    n_model, n_cl = totals or (len(model_tokens), len(cl100k_tokens))
    return (token_chips(model_tokens, f"{model_name}: {n_model:,} tokens", total=n_model)
            + token_chips(cl100k_tokens, f"cl100k_base (GPT-4): {n_cl:,} tokens", total=n_cl))



# The course's palette and its one role palette, shared by the HTML views and the matplotlib figures.
PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
ROLE_COLOURS = {"system": PALETTE[4], "default system prompt": PALETTE[5], "user": PALETTE[0],
                "assistant": PALETTE[2], "generation prompt": PALETTE[1]}


def token_label(text: str) -> str:
    """A token's text as plots and tables show it: escapes visible, spaces as ␣. Example: " Paris" -> "␣Paris" """
    return repr(text)[1:-1].replace(" ", "␣")


def context_view(segments) -> str:
    """The exact rendered context, each segment on the background colour of its role, with token counts."""
    blocks = []
    for seg in segments:
        colour = ROLE_COLOURS.get(seg.label, PALETTE[7]) + "40"  # note: the role colour at 25% opacity, so text stays readable
        text = html.escape(seg.text)
        for marker in ("&lt;|im_start|&gt;", "&lt;|im_end|&gt;"):  # special tokens stand out
            text = text.replace(marker, f'<b style="color:#C44E52">{marker}</b>')
        blocks.append(f'<div style="background:{colour};padding:2px 6px;margin:1px 0;white-space:pre-wrap;'
                      f'font-family:monospace;font-size:12px"><span style="float:right;opacity:.6">{seg.label}: '
                      f'{len(seg.ids)} tokens</span>{text}</div>')
    return "<div>" + "".join(blocks) + "</div>"


def probability_bars(labels: list[str], before: list[float], after: list[float],
                     drawn: list[float] | None = None) -> str:
    """Horizontal bars: grey = before the setting, blue = after (the kept set), orange tick = share drawn."""
    scale = max(max(before), max(after), max(drawn or [0])) or 1.0
    rows = []
    for i, label in enumerate(labels):
        kept = after[i] > 0
        tick = ""
        if drawn is not None:
            tick = (f'<div style="position:absolute;left:{100 * drawn[i] / scale:.1f}%;top:0;height:100%;'
                    f'border-left:3px solid #DD8452"></div>')
        rows.append(
            f'<div style="display:flex;align-items:center;height:20px;font-family:monospace;font-size:12px">'
            f'<div style="width:110px;text-align:right;padding-right:6px;white-space:pre;'
            f'{"" if kept else "color:#aaa;text-decoration:line-through"}">{_visible(label)}</div>'
            f'<div style="position:relative;flex:1;height:16px;background:#f4f4f4">'
            f'<div style="position:absolute;width:{100 * before[i] / scale:.1f}%;height:40%;top:0;background:#bbb"></div>'
            f'<div style="position:absolute;width:{100 * after[i] / scale:.1f}%;height:60%;bottom:0;background:#4C72B0"></div>'
            f'{tick}</div><div style="width:120px;padding-left:6px">{before[i]:.3f} → <b>{after[i]:.3f}</b></div></div>')
    legend = ('<div style="font-size:11px;color:#555">grey: before (temperature 1, no filter) · blue: after this '
              'setting · struck out: filtered away' + (" · orange: share of draws" if drawn is not None else "") + "</div>")
    return legend + "".join(rows)


def attention_table(weights, tokens: list[str], title: str = "") -> str:
    """One head's attention as an HTML heatmap (rows look, columns are looked at); grey cells are masked."""
    head = "".join(f'<th style="writing-mode:vertical-rl;font-weight:normal;padding:2px">{_visible(t)}</th>' for t in tokens)
    rows = []
    for q, token in enumerate(tokens):
        cells = []
        for k in range(len(tokens)):
            if k > q:
                cells.append('<td style="background:#eee"></td>')
            else:
                w = float(weights[q][k])
                shade = f"rgba(31,90,180,{w:.3f})"
                cells.append(f'<td title="{w:.3f}" style="background:{shade};width:22px;height:18px;'
                             f'color:{"#fff" if w > 0.5 else "#333"};font-size:8px;text-align:center">'
                             f'{int(round(w * 100)) if w >= 0.1 else ""}</td>')
        rows.append(f'<tr><th style="text-align:right;font-weight:normal;padding-right:4px">{_visible(token)}</th>'
                    f'{"".join(cells)}</tr>')
    caption = f'<caption style="font-weight:bold">{html.escape(title)}</caption>' if title else ""
    return (f'<table style="border-collapse:collapse;font-family:monospace;font-size:11px">{caption}'
            f'<tr><th></th>{head}</tr>{"".join(rows)}</table>'
            '<div style="font-size:10px;color:#555">numbers: % of attention (shown from 10%); grey: masked (the future)</div>')


def highlighted_tokens(pieces: list[str], marked: list[bool], legend: str = "marked") -> str:
    """A text as its token pieces, the marked ones on a coloured background (for example: tokens a drafter
    guessed and the model accepted). Whitespace is kept as it is."""
    spans = [f'<span style="background:{PALETTE[2]}55">{html.escape(p)}</span>' if m else html.escape(p)
             for p, m in zip(pieces, marked)]
    return (f'<div style="font-size:12px;margin-bottom:4px"><span style="background:{PALETTE[2]}55">highlighted</span>: '
            f'{html.escape(legend)} ({sum(marked)} of {len(marked)} tokens)</div>'
            f'<div style="white-space:pre-wrap;font-family:monospace;font-size:13px">{"".join(spans)}</div>')


def tokenizer_comparison(tokenizer, text: str) -> str:
    """What the tokenizer box shows for `text`: both tokenizations as chips with their counts. Every token is
    counted, but chips are built only for those drawn (MAX_CHIPS each), so a pasted book stays responsive."""
    from ..text.tokenization import Token, cl100k, encode, tokens_of
    ids, cl_ids = encode(tokenizer, text), cl100k().encode(text, disallowed_special=())
    cl_tokens = [Token(i, cl100k().decode_single_token_bytes(i)) for i in cl_ids[:MAX_CHIPS]]
    return compare(tokens_of(tokenizer, ids[:MAX_CHIPS]), cl_tokens, totals=(len(ids), len(cl_ids)))


def sampling_view(logits, labels: dict[int, str], config, show: int = 12, history=(), drawn=None):
    """What the sampling explorer shows for one setting: (bars HTML, readout HTML, the token IDs shown).
    logits: (V,) computed once; config: sampling.SamplingConfig; drawn: frequencies of drawn samples or None."""
    from ..engine.sampling import reshape
    r = reshape(logits, config, show, history)
    bars = probability_bars([labels[i] for i in r.ids], r.before, r.after, drawn)
    readout = (f"<b>kept tokens:</b> {r.kept:,} of {logits.shape[-1]:,} · <b>effective choices</b> "
               f"(2<sup>entropy</sup>): {r.choices_before:.1f} → {r.choices_after:.1f}")
    return bars, readout, r.ids


def footprint_table(rows: list[dict], chosen: int, bytes_per_token: float) -> str:
    """paged.footprint rows (one per block size) as a table, the chosen block size highlighted."""
    head = "".join(f"<th style='padding:2px 8px'>{h}</th>" for h in
                   ("block size", "blocks", "MB held", "empty slots", "shared blocks", "table entries"))
    body = ""
    for r in rows:
        style = "background:#fde8c8;font-weight:bold" if r["block_size"] == chosen else ""
        cells = (r["block_size"], f"{r['blocks']:,}", f"{r['slots'] * bytes_per_token / 1e6:.1f}",
                 f"{r['empty_slots']:,}", f"{r['shared_blocks']:,}", f"{r['table_entries']:,}")
        body += f"<tr style='{style}'>" + "".join(f"<td style='padding:2px 8px;text-align:right'>{c}</td>" for c in cells) + "</tr>"
    return f"<table style='border-collapse:collapse;font-size:13px'><tr>{head}</tr>{body}</table>"
