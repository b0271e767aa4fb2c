"""The offline report: every plot of a session as a PNG plus one self-contained HTML page.

    write_report(session_or_trace, "report/", tokenizer=tok)
    kimi-explore report --prompt "Kimi K3, one token at a time." --out report/    # the CLI's entry (cli.py)

The page inlines every image as a base64 `data:` URI and its CSS in a <style> element: it has no
script, no external link, and opens offline from a file or an e-mail attachment. The PNGs sit next
to it for slides and issues.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import numpy as np

from ...inspection.npz_io import write_atomically
from ..common import no_predictions, trace_labels, trace_of
from . import plots, plots_summary

__all__ = ["default_layers", "write_report"]

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1400px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: .92em; max-width: 60em; }
table { border-collapse: collapse; font-size: .9em; } td, th { border: 1px solid #ddd; padding: .25em .6em; }
th { background: #f5f5f5; } code { background: #f3f3f3; padding: 0 .25em; }
nav ol { columns: 2; font-size: .92em; } .wide { max-width: 100%; overflow-x: auto; }
"""


def _pick(ids: list[int], n: int) -> list[int]:
    """Up to n evenly spaced entries of ids (always the first and the last)."""
    if len(ids) <= n:
        return list(ids)
    return [ids[int(round(p))] for p in np.linspace(0, len(ids) - 1, n)]


def default_layers(trace) -> list[int]:
    """Up to three layers for the per-layer views, ending at the deepest KDA + MoE layer (every view has
    something there; the first layers have few sealed blocks to show)."""
    moe = {int(i) for i in trace.routing()["moe_layers"]}
    both = [int(i) for i in trace.kda_state_norms()[1] if int(i) in moe]
    ids = both or [int(i) for i in trace.layer_ids]
    return _pick(ids[len(ids) // 3:], 3)


def _figures(trace, tokenizer, layers) -> list[tuple[str, str, str, object]]:
    """(section, file stem, caption, figure) for every view the trace supports."""
    last = len(trace) - 1
    label = trace_labels(trace, tokenizer)[last]
    layer_ids = [int(i) for i in trace.layer_ids]
    show = [i for i in (layers if layers is not None else default_layers(trace)) if i in layer_ids]
    out = [("Block attention residuals", "block_residuals_last_token",
            f"Softmax weights over the sources (embedding, sealed blocks, the current running sum) at both sites of "
            f"every layer, for the last token {label}; right: the final output mix before the last norm.",
            plots.block_residual_token(trace, last, tokenizer))]
    for i in show:
        out.append(("Block attention residuals", f"block_residuals_layer{i}",
                    f"Layer {i}: the same weights for every token of the prompt.",
                    plots.block_residual_layer(trace, i, tokenizer)))
    kda_norms, kda_ids = trace.kda_state_norms()
    if len(kda_ids):
        kda_show = [i for i in show if i in kda_ids] or _pick([int(i) for i in kda_ids], 1)
        out += [("KDA recurrent state", "kda_state_curves",
                 "Frobenius norm of each KDA head's recurrent state S over the prompt (mean over heads; band min..max), "
                 "for up to four evenly spaced KDA layers (the title says which share).",
                 plots.kda_state_curves(trace, tokenizer=tokenizer)),
                ("KDA recurrent state", "kda_state_last_token", f"Every KDA layer and head after the last token {label}.",
                 plots.kda_state_overview(trace, last, tokenizer))]
        finite = np.asarray(kda_norms, dtype=np.float64)[np.isfinite(kda_norms)]  # (an inf norm would blank them all)
        vmax = float(finite.max()) if finite.size else None  # one scale for the section
        out[-1] = (*out[-1][:3], plots.kda_state_overview(trace, last, tokenizer, vmax=vmax))
        out += [("KDA recurrent state", f"kda_state_layer{i}", f"KDA layer {i}: per head, token by token "
                 "(same colour scale as the figure above).", plots.kda_state_heatmap(trace, i, tokenizer, vmax=vmax))
                for i in kda_show]
    moe = trace.routing()["moe_layers"]
    if len(moe):
        moe_show = [i for i in show if i in moe] or _pick([int(i) for i in moe], 1)
        out += [("MoE routing", "moe_routing_last_token",
                 f"Router scores of every expert at every MoE layer for the last token {label}; the chosen top-k marked.",
                 plots.moe_routing_token(trace, last, tokenizer))]
        out += [("MoE routing", f"moe_routing_layer{i}", f"MoE layer {i}: router scores and choices over the prompt.",
                 plots.moe_routing_layer(trace, i, tokenizer)) for i in moe_show]
        out += [("MoE routing", "moe_layer_stats", "Per MoE layer: the entropy of the combine weights (last token and "
                 "mean), and the load over the prompt: max/mean count, coefficient of variation, experts never chosen.",
                 plots_summary.moe_layer_stats(trace, last, tokenizer)),
                ("MoE routing", "moe_sorted_counts", "Each MoE layer's expert counts over the prompt, sorted: a balanced "
                 "router gives flat rows.", plots_summary.moe_sorted_counts(trace)),
                ("MoE routing", "moe_output_norms", "L2 norm of the routed and the shared experts' outputs per layer.",
                 plots.moe_output_norms(trace))]
    out.append(("Next-token predictions", "predictions_last_token", f"Top next-token probabilities after {label}.",
                plots.predictions(trace, last, tokenizer)))
    return out


def _contents(sections: dict[str, list[str]]) -> str:
    """The table of contents: every section, and the figures in it by file name."""
    items = []
    for n, (section, parts) in enumerate(sections.items()):
        stems = [p.split('alt="', 1)[1].split('"', 1)[0] for p in parts if p.startswith("<figure")]
        sub = ", ".join(f"<a href='#{html.escape(st)}'>{html.escape(st)}</a>" for st in stems)
        items.append(f"<li><a href='#s{n}'>{html.escape(section)}</a>" + (f"<br><small>{sub}</small>" if sub else "")
                     + "</li>")
    return "<nav><h2>Contents</h2><ol>" + "".join(items) + "</ol></nav>"


def _prediction_table(trace, tokenizer, top: int = 5, max_rows: int = 64) -> str:
    ids, probs = trace["logits.top_ids"], trace["logits.top_probs"]
    labels = trace_labels(trace, tokenizer)
    rows = []
    for t in range(min(len(trace), max_rows)):
        if no_predictions(probs[t]):
            rows.append(f"<tr><td>{html.escape(labels[t])}</td><td>none: the logits hold NaN</td></tr>")
            continue
        preds = ", ".join(f"{html.escape(plots.token_labels([int(i)], tokenizer, positions=False)[0])} {p:.3f}"
                          for i, p in zip(ids[t][:top], probs[t][:top], strict=True) if i >= 0)
        rows.append(f"<tr><td>{html.escape(labels[t])}</td><td>{preds}</td></tr>")
    more = f"<p>({len(trace) - max_rows} more tokens not shown)</p>" if len(trace) > max_rows else ""
    head = f"<table><tr><th>token</th><th>top-{min(top, ids.shape[1])} next-token predictions</th></tr>"
    return head + "".join(rows) + "</table>" + more


def write_report(session_or_trace, out_dir, tokenizer=None, layers=None, title: str = "Kimi K3, token by token",
                 dpi: int = 100, source: str = "", top: int = 5, comparison=None) -> Path:
    """Write `<out_dir>/*.png` and `<out_dir>/index.html` (self-contained); returns the HTML path.

    session_or_trace: a `Session` (its trace and tokenizer are used) or a `Trace`.
    layers: model layer ids for the per-layer views (default: `default_layers`, up to three ending at the
    deepest KDA + MoE layer).
    top: predictions per token in the table (at most the recorder's `top_k`).
    comparison: a `ke.compare` result, shown as its layer x site heatmaps (`engine_plots.report_figures`).
    A report written to `out_dir` before is replaced whole: its PNGs this one does not write are removed
    (other files are left alone), and index.html is replaced in one step.
    """
    trace, tokenizer = trace_of(session_or_trace, tokenizer)
    if len(trace) == 0:
        raise ValueError("write_report: the trace is empty; feed at least one token first")
    if comparison is not None and [int(t) for t in comparison.tokens] != trace.tokens.tolist():
        raise ValueError(f"write_report: the comparison's {len(comparison.tokens)} token ids are not the trace's "
                         f"{len(trace)}; report a session that ran the tokens compared (ke.compare feeds them to an "
                         "empty session)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    before = _figures_of_page(out / "index.html")  # a report written here before: its PNGs are replaced below
    sections: dict[str, list[str]] = {}
    try:
        figures = _figures(trace, tokenizer, layers)
    except KeyError as e:  # a Recorder(names_filter=...) that left out records every report draws
        what = e.args[0] if e.args else e
        said = what if isinstance(what, str) and " " in what else f"the trace has no {what!r} records."
        raise ValueError(f"write_report: the report draws every record of the default ke.Recorder(), and this trace "
                         f"lacks some (recorded with a names_filter= that leaves them out?): {said}") from None
    notes = []
    if hasattr(session_or_trace, "step"):  # the analyses replay a session's history; a bare trace cannot
        from .analysis_plots import report_figures

        for entry in report_figures(session_or_trace, tokenizer):
            (figures if entry[3] is not None else notes).append(entry)
    if comparison is not None:
        from .engine_plots import report_figures as comparison_figures

        figures += comparison_figures(comparison)
    for section, stem, caption, fig in figures:
        png = plots.figure_png(fig, dpi=dpi)
        write_atomically(out / f"{stem}.png", lambda tmp, png=png: tmp.write_bytes(png))
        data = base64.b64encode(png).decode("ascii")
        sections.setdefault(section, []).append(
            f'<figure id="{html.escape(stem)}"><img alt="{html.escape(stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption><code>{html.escape(stem)}.png</code> &middot; {html.escape(caption)}</figcaption></figure>")
    for section, _, message, _ in notes:  # an analysis that could not run here: said where its figure would be
        sections.setdefault(section, []).append(f"<p><i>{html.escape(message)}</i></p>")
    body = [f"<h1>{html.escape(title)}</h1>",
            f"<p>{len(trace)} tokens through layers {html.escape(str(list(trace.layer_ids)))}"
            + (f" of <code>{html.escape(str(source))}</code>" if source else "") + ".</p>",
            *_tokens(trace, tokenizer, getattr(session_or_trace, "generated", None))]
    if len(trace.routing()["moe_layers"]):  # a Session's: with its routers' bias and top-k
        sections.setdefault("MoE routing", []).insert(0, plots_summary.topk_table_html(session_or_trace, -1,
                                                                                       tokenizer=tokenizer))
    sections["Predictions at every step"] = [_prediction_table(trace, tokenizer, top)]
    body.append(_contents(sections))
    for n, (section, figs) in enumerate(sections.items()):
        body += [f"<h2 id='s{n}'>{html.escape(section)}</h2>", *figs]
    page = ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
    path = write_atomically(out / "index.html", lambda tmp: tmp.write_text(page, encoding="utf-8"))
    for stem in before - {stem for _, stem, _, _ in figures}:  # the earlier report's figures this one does not have:
        (out / f"{stem}.png").unlink(missing_ok=True)  # left, they would pass for this prompt's (other layers...)
    return path


def _tokens(trace, tokenizer, generated) -> list[str]:
    """The text line, and the tokens line with the tokens `generate` chose (`Session.generated`) underlined (dotted)."""
    tokens = [int(t) for t in trace.tokens]
    flags = list(generated) if generated is not None and len(generated) == len(tokens) else [False] * len(tokens)
    runs: list[tuple[bool, list[int]]] = []
    for t, g in zip(tokens, flags, strict=True):
        if runs and runs[-1][0] == g:
            runs[-1][1].append(t)
        else:
            runs.append((g, [t]))

    def shown(g: bool, text: str) -> str:
        return f"<u style='text-decoration-style:dotted' title='generated'>{text}</u>" if g else text
    out = []
    if tokenizer is not None:  # decoded whole: a character split over a run's edge comes out whole
        out.append(f"<p>Text: <code>{html.escape(tokenizer.decode([t for t in tokens if t >= 0]))}</code></p>")
    pieces = " ".join(shown(g, html.escape(" ".join(plots.token_labels(ids, tokenizer, positions=False))))
                      for g, ids in runs)
    note = " (dotted: generated by <code>Session.generate</code>)" if any(flags) else ""
    out.append(f"<p>Tokens{note}: <code>{pieces}</code></p>")
    return out


def _figures_of_page(page: Path) -> set[str]:
    """The file stems of the figures an earlier `write_report` page shows (empty: no page there)."""
    try:
        text = page.read_text(encoding="utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return set()
    return {html.unescape(m) for m in re.findall(r'<figure id="([^"]+)"><img alt="[^"]*" src="data:image/png;base64,', text)
            if re.fullmatch(r"[\w.-]+", html.unescape(m))}
