"""The analyses a K3 researcher runs on a session, built on its trace and hooks only.

    lens = ke.logit_lens(session, top=5, targets="next")   # logit_lens.py: the prediction after every layer
    attr = ke.logit_attribution(session, t, token=None)    # attribution.py: an exact split of one logit
    d = ke.diff(session, fork)                             # diff.py: what changed, site by site
    stats = ke.routing_stats(weights, texts)               # routing_stats.py: what each expert does over a corpus
    res = ke.source_ablation(session)                      # source_ablation.py: block-residual mass vs causal effect

Views: `kimi_explore.views.figures.analysis_plots`.
"""
