"""The loss pipeline (docs/contributing.md, "One loss call"):

    token_sets     who shares a ratio: t's segment (``segments/``), the prefix {1..t}, the whole response; the sums
                   of delta over each set and the set sizes
    surrogates     what the objective does with r_t: one per-token formula each, autograd's gradient; the clip
                   schedules (ratio-space bounds or log-space n^p bounds)
    losses         the loss verl calls, steps 1 to 10 (docs/contributing.md): delta_t, the surrogate's per-token step,
                   l_t = sum_{S(t)} delta / |S(t)|^alpha, r_t in stop-gradient form, the surrogate, verl's aggregation
    metrics        the metrics of one call in one batched transfer; the ratio-correlation sums
    reference_loss the same loss written plainly, top to bottom: the tests' oracle

Importing it registers and patches nothing (the plugin does).
"""
