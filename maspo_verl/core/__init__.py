"""The loss pipeline, one file per step (docs/contributing.md, "One loss call"):

    token_sets     who shares a ratio: t's segment (``segments/``), the prefix {1..t}, the whole response
    ratios         delta_t, the shared log-ratio sum_{S(t)} delta / |S(t)|^alpha, r_t in stop-gradient form
    clipping       the clip schedule: ratio-space bounds or log-space n^p bounds
    surrogates     what the objective does with r_t: one per-token formula each, autograd's gradient
    losses         the loss verl calls: the steps above, verl's aggregation, one batched metrics transfer
    correlation    do the token log-ratios move together: lag-1 and VIF(n) sums, reported with the loss
    reference_loss the same loss written plainly, top to bottom: the tests' oracle

Importing it registers and patches nothing (the plugin does).
"""
