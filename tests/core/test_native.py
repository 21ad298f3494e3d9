"""The C path of the segmentation (``maspo_verl.native``) against the torch path: the same segment ids,
rule metrics and segment sizes on generated inputs (every rule, the words fallback, right/left padding
and holes, min/max lengths, every input dtype, several threads); how it is built, cached and skipped."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maspo_verl import native, segments
from maspo_verl.batch import NO_WORD, WORD_IDS_KEY, micro_batch_scope
from maspo_verl.config import GranularLossConfig
from maspo_verl.segments import fallback_rules
from maspo_verl.segments.rules import logprob
from tests.core.test_segments import masks

settings.register_profile("native", deadline=None, max_examples=300)

pytestmark = pytest.mark.skipif(native.unavailable() is not None, reason=f"no C path: {native.unavailable()}")

CODECS = [
    dict(codec_size=64, fsq_levels=[4, 4, 4]),
    dict(codec_size=81, fsq_levels=[3, 3, 3, 3]),  # digits by division
    dict(codec_size=4096, fsq_levels=[4] * 6),  # byte groups of a 12-bit code
    dict(codec_size=65536, fsq_levels=[4] * 8),  # XCodec2: two whole bytes
    dict(codec_size=600, fsq_levels=[300, 2]),  # a digit above one byte, computed directly
    dict(codec_size=600, fsq_levels=[2, 300]),
]


# the rules with a C kernel (``SegmentRule.native_code``): each must give the torch path's ids
NATIVE_RULES = [name for name, rule in segments.SEGMENT_RULES.items() if rule.native_code is not None]


@st.composite
def cases(draw):
    """A mask, a config and the rule's inputs, at the edges the rules have."""
    mask = draw(masks(max_b=6, max_t=40))
    B, T = mask.shape
    rule = draw(st.sampled_from(NATIVE_RULES))
    min_len = draw(st.sampled_from([0, 1, 2, 3, 5, 20]))  # 20: the long-window suppression
    codec = draw(st.sampled_from(CODECS))
    fields = dict(
        segment_rule=rule,
        segment_window=draw(st.integers(1, 9)),
        logprob_threshold=draw(st.sampled_from([-0.5, 0.0, 0.3, 1.0, 2.0])),
        logprob_per_sample=draw(st.booleans()),
        tokenval_threshold=draw(st.sampled_from([0.0, 1.0, 3.0, 8.0])),
        tokenval_distance=draw(st.sampled_from(["id", "fsq_l1", "fsq_hamming"])),
        codec_offset=100,
        min_segment_len=min_len,
        max_segment_len=draw(st.sampled_from([0, max(min_len, 1), min_len + 4])),
        words_fallback_rule=draw(st.sampled_from([r for r in NATIVE_RULES if r in fallback_rules()])),
        **codec,
    )
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    # rounded log-probs: equal drops (ties for min-length suppression) are common
    lp = (torch.randn(B, T, generator=g) * draw(st.sampled_from([0.3, 1.0, 3.0]))).round(
        decimals=draw(st.sampled_from([0, 1, 4]))
    )
    if draw(st.booleans()):
        lp[torch.rand(B, T, generator=g) < 0.1] = draw(st.sampled_from([-math.inf, math.inf, math.nan]))
    lp = lp.to(draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])))
    top = 100 + codec["codec_size"]
    tokens = torch.randint(60, top + 20, (B, T), generator=g)  # some outside the codec on either side
    if draw(st.booleans()):  # runs of near codes, as on speech
        tokens = torch.randint(100, 110, (B, T), generator=g)
    tokens = tokens.to(draw(st.sampled_from([torch.int64, torch.int32])))
    words = torch.randint(-1, 4, (B, T), generator=g).sort(-1).values
    words[torch.rand(B, generator=g) < 0.3] = NO_WORD  # rows without words take the fallback
    fields["turn_window"] = draw(st.integers(0, 9))
    return mask, fields, lp, tokens, words


def segment(mask, fields, lp, tokens, words, kernel, sizes_dtype=torch.float32):
    metrics = {}
    config = GranularLossConfig(loss_mode="maspo", segment_kernel=kernel, **fields)
    with micro_batch_scope({"responses": tokens, WORD_IDS_KEY: words}):
        ids, sizes = segments.compute_segments(mask, config, old_log_prob=lp, metrics=metrics, sizes_dtype=sizes_dtype)
    return ids, sizes, metrics


def assert_same(c_path, torch_path):
    (ids, _, metrics), (ref, _, ref_metrics) = c_path, torch_path
    assert ids.dtype == ref.dtype == torch.long
    assert torch.equal(ids, ref)
    assert metrics.keys() == ref_metrics.keys()
    for name in metrics:
        assert metrics[name].dtype == ref_metrics[name].dtype
        assert torch.equal(metrics[name], ref_metrics[name]), name


@settings(settings.get_profile("native"))
@given(cases(), st.sampled_from([torch.float32, torch.float64]))
def test_c_path_gives_the_torch_paths_ids_metrics_and_sizes(case, sizes_dtype):
    c_path = segment(*case, "auto", sizes_dtype)
    torch_path = segment(*case, "torch", sizes_dtype)
    assert_same(c_path, torch_path)
    assert torch_path[1] is None  # the torch path leaves the sizes to the caller
    mask, ids, sizes = case[0], c_path[0], c_path[1]
    # the sizes: a scatter-add of the mask over the ids
    assert sizes.dtype == sizes_dtype
    assert torch.equal(sizes, torch.zeros_like(sizes).scatter_add_(-1, ids, mask.to(sizes_dtype)))


def test_many_rows_split_over_threads(monkeypatch):
    """Rows go to several threads (a slice each, here of a few rows): the same ids as the torch path."""
    monkeypatch.setattr(native, "TOKENS_PER_THREAD", 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        g = torch.Generator().manual_seed(0)
        B, T = 37, 300
        lengths = torch.randint(0, T + 1, (B,), generator=g)
        mask = torch.arange(T) < lengths[:, None]
        lp = -torch.rand(B, T, generator=g) * 3
        tokens = 128264 + torch.randint(0, 65536, (B, T), generator=g)
        words = (torch.arange(T) // 7).expand(B, T).clone()
        words[::3] = NO_WORD
        for rule in NATIVE_RULES:
            fields = dict(segment_rule=rule, logprob_per_sample=True, min_segment_len=3, max_segment_len=20)
            case = (mask, fields, lp, tokens, words)
            assert_same(segment(*case, "auto"), segment(*case, "torch"))
    finally:
        torch.set_num_threads(threads)


def test_torch_kernel_and_non_cpu_tensors_never_reach_the_library(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the C path ran")

    monkeypatch.setattr(native, "segment_ids", refuse)
    mask, lp = torch.ones(2, 9, dtype=torch.bool), -torch.rand(2, 9)
    for kernel in ["torch", "auto"]:
        config = GranularLossConfig(loss_mode="maspo", segment_rule="logprob", segment_kernel=kernel)
        segments.compute_segment_ids(mask.to("meta"), config, old_log_prob=lp.to("meta"))  # not a CPU tensor
        if kernel == "torch":
            segments.compute_segment_ids(mask, config, old_log_prob=lp)
    with pytest.raises(AssertionError, match="the C path ran"):  # the check itself can fail
        segments.compute_segment_ids(mask, config, old_log_prob=lp)


def test_per_sample_cutoff_is_decided_in_float64():
    """``above`` compares float32 drops with float64 cutoffs exactly; the per-sample boundaries are the
    drops above mean + threshold * population std (float64), from a direct computation."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g)
    c = x.double() + torch.randn(4000, generator=g, dtype=torch.float64) * 1e-9  # cutoffs within float32 spacing
    c[::7] = x[::7].double()  # exactly equal: not above
    assert torch.equal(logprob.above(x, c), x.double() > c)
    lp = (-torch.rand(3, 50, generator=g) * 4).float()
    mask = torch.ones(3, 50, dtype=torch.bool)
    for kernel in ["auto", "torch"]:
        config = GranularLossConfig(
            loss_mode="maspo",
            segment_rule="logprob",
            logprob_per_sample=True,
            logprob_threshold=0.7,
            segment_kernel=kernel,
        )
        ids = segments.compute_segment_ids(mask, config, old_log_prob=lp)
        for row in range(3):
            drops = [float(a) - float(b) for a, b in zip(lp[row, :-1], lp[row, 1:], strict=True)]
            drops = [float(torch.tensor(d, dtype=torch.float32)) for d in drops]  # float32 drops
            mu = math.fsum(drops) / len(drops)
            sd = math.sqrt(math.fsum((d - mu) ** 2 for d in drops) / len(drops))
            starts = [0] + [t + 1 for t, d in enumerate(drops) if d > mu + 0.7 * max(sd, logprob.STD_FLOOR)]
            assert torch.nonzero(torch.diff(ids[row], prepend=ids[row, :1] - 1)).flatten().tolist() == starts


def test_without_a_compiler_the_torch_path_runs_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("MASPO_VERL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path))
    native.load_library.cache_clear()
    try:
        assert "no-such-cc" in native.unavailable()
        mask = torch.ones(2, 12, dtype=torch.bool)
        lp = -torch.rand(2, 12)
        config = GranularLossConfig(loss_mode="maspo", segment_rule="logprob", min_segment_len=2)
        with pytest.warns(UserWarning, match="segmentation runs on torch ops: the C path is unavailable"):
            ids = segments.compute_segment_ids(mask, config, old_log_prob=lp)
        native.load_library.cache_clear()
        monkeypatch.delenv("CC")
        assert torch.equal(ids, segments.compute_segment_ids(mask, config, old_log_prob=lp))
    finally:
        native.load_library.cache_clear()


def test_the_library_is_built_once_and_loaded_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MASPO_VERL_CACHE", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    native.load_library.cache_clear()
    try:
        assert native.unavailable() is None
        built = list(tmp_path.glob("segment_ids-*.so"))
        assert len(built) == 1 and not list(tmp_path.glob(".*"))  # no half-written file left
        # a second process (a cleared cache) loads the file: it never calls the compiler again
        native.load_library.cache_clear()
        monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
        assert native.unavailable() is None
    finally:
        native.load_library.cache_clear()
