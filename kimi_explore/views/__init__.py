"""What K3 did, drawn: two rooms that share only `common.py` (labels, index checks) and `summaries.py`
(the K3-scale MoE numbers).

  figures/    static matplotlib figures (PNG): `plots`, `plots_summary`, `analysis_plots`,
              `learned_plots`, and `report` (all of them on one offline HTML page)
  explorer/   the interactive `Explorer` (ipywidgets + anywidget, plotly.js from the installed wheel):
              `widgets` (the Explorer), `tabs`, `specs` / `specs_moe` (trace -> plotly spec),
              `ablation`, `plotly_view`, `token_text`
"""
