"""The limits of docs/algorithms.md §5 in float64, against the installed verl's own losses and
independent loop references."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from maspo_verl import segments
from maspo_verl.batch import WORD_IDS_KEY, micro_batch_scope
from maspo_verl.segments import RESPONSE_IDS, SEGMENT_RULES, TOKENIZER
from tests.helpers import actor_config, random_batch

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"]


def loss_and_grad(name, config, old, new, adv, mask, agg):
    loss, metrics = get_policy_loss_fn(name)(old, new, adv, mask, agg, config)
    (grad,) = torch.autograd.grad(loss, new)
    return loss.detach(), grad, metrics


def gspo_agg_mode(agg: str) -> str:
    """The aggregation verl's ``gspo`` really applies when asked for ``agg``: verl 0.9.1 follows
    ``loss_agg_mode``; verl 0.9.0 and its development branch always use seq-mean-token-mean."""
    old, new, adv, mask = random_batch(scale=0.01, seed=99)
    config = actor_config(3e-4, 4e-4, loss_mode="vanilla")
    asked = get_policy_loss_fn("gspo")(old, new, adv, mask, "token-sum", config)[0]
    fixed = get_policy_loss_fn("gspo")(old, new, adv, mask, "seq-mean-token-mean", config)[0]
    return "seq-mean-token-mean" if torch.equal(asked, fixed) else agg


def assert_close(a, b, tol=1e-6):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3e} > {tol}"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """The local mode's byte-level tokenizer (id b is byte b): "\n" is id 10, "?" id 63, letters their bytes."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from maspo_verl.local.assets import build_tokenizer_json

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(build_tokenizer_json()))


def letters(mask: torch.Tensor, seed: int) -> torch.Tensor:
    """Random lower-case letters (no default delimiter occurs in them), shaped like ``mask``."""
    return torch.randint(ord("a"), ord("z") + 1, mask.shape, generator=torch.Generator().manual_seed(seed))


def codec_ids(mask: torch.Tensor) -> torch.Tensor:
    """Ids inside the default codec range whose neighbours all differ (every code distance > 0)."""
    B, T = mask.shape
    codes = (torch.arange(T) * 7 + torch.arange(B)[:, None] * 13) % 65536
    return codes + 128264


def alternating(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with every other token masked out: each valid token is a run (a turn) of its own."""
    return mask & (torch.arange(mask.shape[1]) % 2 == 0)


@dataclass(frozen=True)
class Case:
    """A setting of one of our losses that must equal a verl loss: its policy-loss settings, the micro-batch fields
    in scope (``scope(mask)``; the byte-level tokenizer with ``tokenizer``) and how the mask is changed."""

    id: str
    settings: dict
    scope: Callable | None = None
    tokenizer: bool = False
    reshape_mask: Callable | None = None


def declared(limit: str) -> list[Case]:
    """Each rule's declared ``limit`` (``SegmentRule.limits``), with the inputs it reads: old log-probs, codec
    ids whose neighbours differ, no word ids (rows fall back), the byte-level tokenizer."""
    cases = []
    for rule in SEGMENT_RULES.values():
        if limit in rule.limits:
            reads_ids = RESPONSE_IDS in segments.inputs_needed(actor_config(segment_rule=rule.name).policy_loss)
            cases.append(
                Case(
                    f"{rule.name}-declared",
                    {"segment_rule": rule.name, **rule.limits[limit]},
                    (lambda mask: {"responses": codec_ids(mask)}) if reads_ids else None,
                    tokenizer=TOKENIZER in rule.needs,
                )
            )
    return cases


def one_word(mask):
    return {WORD_IDS_KEY: torch.zeros(mask.shape, dtype=torch.long)}


def word_per_token(mask):
    return {WORD_IDS_KEY: torch.arange(mask.shape[1]).expand(mask.shape)}


def delimiter_at_the_end(mask):
    ids = letters(mask, 5)
    ids[torch.arange(mask.shape[0]), mask.sum(-1) - 1] = ord("\n")
    ids[~mask] = ord("\n")  # padding holds delimiters too: it must not count
    return {"responses": ids}


def delimiter_everywhere(mask):
    return {"responses": torch.where(letters(mask, 6) < ord("m"), ord("\n"), ord("?"))}


# the sequence ratio: every declared limit, and inputs under which a rule finds one segment per response
GSPO_CASES = declared("sequence") + [
    Case("fixed-window-T", {"segment_rule": "fixed", "segment_window": 20}),
    Case("words-one-word-over-everything", {"segment_rule": "words", "words_fallback_rule": "fixed"}, one_word),
    Case("delimiters-only-at-the-end", {"segment_rule": "delimiters"}, delimiter_at_the_end, tokenizer=True),
    Case("turns-no-holes", {"segment_rule": "turns"}),
    Case("pgspo-alpha-one", {"loss_mode": "pgspo"}),
]
# the token ratio: every declared limit, and inputs under which a rule gives every token a segment
VANILLA_CASES = declared("token") + [
    Case("words-one-word-per-token", {"segment_rule": "words", "words_fallback_rule": "fixed"}, word_per_token),
    Case(
        "delimiters-everywhere", {"segment_rule": "delimiters", "delimiters": ["\n", "?"]}, delimiter_everywhere, True
    ),
    Case(
        "step-markers-everywhere",
        {"segment_rule": "delimiters", "delimiters": [], "step_markers": ["\n", "?"]},
        delimiter_everywhere,
        True,
    ),
    Case("turns-every-token-its-own-run", {"segment_rule": "turns"}, reshape_mask=alternating),
    Case("turns-window-one-with-holes", {"segment_rule": "turns", "turn_window": 1}, reshape_mask=alternating),
]


def run_case(case: Case, config, old, new, adv, mask, agg, tokenizer):
    mask = case.reshape_mask(mask) if case.reshape_mask else mask
    settings = dict(case.settings)
    loss_mode = settings.setdefault("loss_mode", "maspo")
    scope = micro_batch_scope(case.scope(mask) if case.scope else {}, tokenizer if case.tokenizer else None)
    with scope:
        return loss_and_grad(loss_mode, config(**settings), old, new, adv, mask, agg), mask


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("case", GSPO_CASES, ids=lambda c: c.id)
def test_one_ratio_per_response_is_verl_gspo(case, agg, per_token, byte_tokenizer):
    """Per-token advantages (span credit) with one shared ratio: verl's GSPO-token."""
    old, new, adv, mask = random_batch(scale=0.01, seed=2, per_token=per_token)
    ours, mask = run_case(
        case, lambda **kw: actor_config(3e-4, 4e-4, **kw), old, new, adv, mask, gspo_agg_mode(agg), byte_tokenizer
    )
    verl = loss_and_grad("gspo", actor_config(3e-4, 4e-4, loss_mode="vanilla"), old, new, adv, mask, agg)
    assert_close(ours[0], verl[0])
    assert_close(ours[1], verl[1])
    assert ours[1].abs().sum() > 0
    if case.settings.get("loss_mode", "maspo") == "maspo":
        assert ours[2]["actor/ratio/segments_per_seq"] == 1.0


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("scale", [0.05, 0.6])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("case", VANILLA_CASES, ids=lambda c: c.id)
def test_one_ratio_per_token_is_verl_vanilla(case, agg, scale, per_token, byte_tokenizer):
    old, new, adv, mask = random_batch(scale=scale, seed=1, per_token=per_token)
    ours, mask = run_case(case, actor_config, old, new, adv, mask, agg, byte_tokenizer)
    verl = loss_and_grad("vanilla", actor_config(loss_mode="vanilla"), old, new, adv, mask, agg)
    assert_close(ours[0], verl[0])
    assert_close(ours[1], verl[1])
    assert ours[1].abs().sum() > 0
    assert ours[2]["actor/ratio/segment_len_mean"] == 1.0
    # the large-scale case really exercises both clips and the dual clip
    if scale > 0.5:
        assert ours[2]["actor/pg_clipfrac"] > 0
    assert ours[2]["actor/pg_clipfrac"] == pytest.approx(verl[2]["actor/pg_clipfrac"], abs=1e-6)


def test_every_rule_declares_a_limit_or_has_a_case():
    """A rule whose settings reach neither limit is still checked against verl through inputs that do."""
    covered = {c.settings.get("segment_rule") for c in GSPO_CASES + VANILLA_CASES}
    assert set(SEGMENT_RULES) <= covered, set(SEGMENT_RULES) - covered


def test_pgspo_alpha_zero_is_the_full_product():
    old, new, adv, mask = random_batch(scale=0.05, seed=4)
    config = actor_config(clip_low=10.0, clip_high=1e6, clip_c=1e9, loss_mode="pgspo", length_exponent=0.0)
    loss, grad, _ = loss_and_grad("pgspo", config, old, new, adv, mask, "token-sum")
    log_product = ((new.detach() - old) * mask).sum(-1, keepdim=True)
    expected = (-adv * torch.exp(log_product) * mask).sum()
    assert_close(loss, expected)
    assert_close(grad, -adv * torch.exp(log_product) * mask)


def test_gspo_worked_example():
    """Seed 003: 512 tokens, two with ratios 1.9 and 0.4, the rest 1.0."""
    old = torch.zeros(1, 512, dtype=torch.float64)
    new = old.clone()
    new[0, 10], new[0, 300] = math.log(1.9), math.log(0.4)
    adv = torch.ones(1, 512, dtype=torch.float64)
    mask = torch.ones(1, 512, dtype=torch.bool)
    for name, kwargs in [("pgspo", {"loss_mode": "pgspo"}), ("maspo", {"segment_window": 512})]:
        _, metrics = get_policy_loss_fn(name)(old, new, adv, mask, "seq-mean-token-mean", actor_config(**kwargs))
        s = metrics["actor/ratio/mean"]
        assert s == pytest.approx(math.exp((math.log(1.9) + math.log(0.4)) / 512), abs=1e-12)
        assert round(s, 4) == 0.9995
        assert metrics["actor/ratio/min"] == metrics["actor/ratio/max"] == pytest.approx(s)


def reference_token_losses(old, new, adv, mask, sets, alpha, bounds):
    """Position-wise float64 loop: sets(i, positions, k) -> indices sharing token k's ratio."""
    losses = torch.zeros_like(new)
    for i in range(new.shape[0]):
        positions = [t for t in range(new.shape[1]) if mask[i, t]]
        for k, t in enumerate(positions):
            members = sets(positions, k)
            total = sum(torch.clamp(new[i, u].detach() - old[i, u], -20, 20) for u in members)
            shared = torch.clamp(total / len(members) ** alpha, -20, 20)
            r = torch.exp(shared + new[i, t] - new[i, t].detach())
            lo, hi, c = bounds(len(members))
            a = adv[i, t]
            pessimistic = torch.maximum(-a * r, -a * torch.clamp(r, lo, hi))
            losses[i, t] = torch.minimum(pessimistic, -a * c) if a < 0 else pessimistic
    return losses


def log_bounds(eps_low, eps_high, eps_c, p):
    return lambda n: (math.exp(-eps_low * n**p), math.exp(eps_high * n**p), math.exp(eps_c * n**p))


@pytest.mark.parametrize("mode,alpha,p", [("cumprod", 0.0, 0.5), ("geomean", 1.0, -0.5), ("cumprod", 0.0, 0.0)])
@pytest.mark.parametrize("per_token", [False, True])
def test_ctpo_matches_position_wise_reference(mode, alpha, p, per_token):
    old, new, adv, mask = random_batch(B=4, T=12, scale=0.15, seed=5, per_token=per_token)
    config = actor_config(loss_mode="ctpo", ctpo_mode=mode, clip_schedule="log_adaptive", clip_exponent=p)
    loss, grad, _ = loss_and_grad("ctpo", config, old, new, adv, mask, "token-mean")
    prefix = lambda positions, k: positions[: k + 1]  # noqa: E731
    ref = reference_token_losses(old, new, adv, mask, prefix, alpha, log_bounds(0.025, 0.05, 0.05, p))
    ref_loss = (ref * mask).sum() / mask.sum()
    (ref_grad,) = torch.autograd.grad(ref_loss, new)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)


def test_ctpo_constant_exponent_is_constant_log_clip():
    """p = 0: bounds exp(-eps_low), exp(eps_high), exp(eps_c) at every position (ratio-space clip with those)."""
    old, new, adv, mask = random_batch(scale=0.2, seed=6)
    log_cfg = actor_config(loss_mode="ctpo", clip_schedule="log_adaptive", clip_exponent=0.0)
    ratio_cfg = actor_config(
        clip_low=1 - math.exp(-0.025), clip_high=math.exp(0.05) - 1, clip_c=math.exp(0.05), loss_mode="ctpo"
    )
    a = loss_and_grad("ctpo", log_cfg, old, new, adv, mask, "token-mean")
    b = loss_and_grad("ctpo", ratio_cfg, old, new, adv, mask, "token-mean")
    assert_close(a[0], b[0])
    assert_close(a[1], b[1])


@pytest.mark.parametrize("mode", ["cumprod", "geomean"])
def test_ctpo_length_one_is_token_ratio(mode):
    old, new, adv, mask = random_batch(B=8, T=1, scale=0.3, seed=7, lengths=[1] * 8)
    ours = loss_and_grad("ctpo", actor_config(loss_mode="ctpo", ctpo_mode=mode), old, new, adv, mask, "token-mean")
    verl = loss_and_grad("vanilla", actor_config(loss_mode="vanilla"), old, new, adv, mask, "token-mean")
    assert_close(ours[0], verl[0])
    assert_close(ours[1], verl[1])


@pytest.mark.parametrize("window", [3, 5])
@pytest.mark.parametrize("per_token", [False, True])
def test_maspo_fixed_window_matches_reference_and_segment_aggregation(window, per_token):
    old, new, adv, mask = random_batch(B=5, T=17, scale=0.2, seed=8, per_token=per_token)
    config = actor_config(segment_window=window, agg_mode="seg-mean-token-mean")
    loss, grad, metrics = loss_and_grad("maspo", config, old, new, adv, mask, "token-mean")
    window_of = lambda positions, k: positions[(k // window) * window : (k // window + 1) * window]  # noqa: E731
    ref = reference_token_losses(old, new, adv, mask, window_of, 1.0, lambda n: (0.8, 1.28, 3.0))
    per_row = []
    for i in range(ref.shape[0]):
        positions = [t for t in range(ref.shape[1]) if mask[i, t]]
        chunks = [positions[s : s + window] for s in range(0, len(positions), window)]
        per_row.append(sum(ref[i, c].mean() for c in chunks) / len(chunks))
    ref_loss = sum(per_row) / len(per_row)
    (ref_grad,) = torch.autograd.grad(ref_loss, new)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    lengths = mask.sum(-1)
    assert metrics["actor/ratio/segments_per_seq"] == pytest.approx(torch.ceil(lengths / window).mean().item())


@pytest.mark.parametrize("agg_mode,loss_agg", [("seg-mean-token-mean", "token-mean"), ("actor", "token-mean")])
def test_aggregation_is_data_parallel_invariant(agg_mode, loss_agg):
    """Two DP ranks with verl's global_batch_info give the single-rank loss and gradient (ranks are averaged)."""
    old, new, adv, mask = random_batch(B=6, T=15, scale=0.2, seed=9)
    fn = get_policy_loss_fn("maspo")
    single = actor_config(segment_window=4, agg_mode=agg_mode)
    full, _ = fn(old, new, adv, mask, loss_agg, single)
    (full_grad,) = torch.autograd.grad(full, new)
    info = {"dp_size": 2, "batch_num_tokens": int(mask.sum()), "global_batch_size": 6, "loss_scale_factor": None}
    total = 0
    for rows in (slice(0, 2), slice(2, 6)):
        cfg = actor_config(segment_window=4, agg_mode=agg_mode)
        cfg.global_batch_info.update(info)
        part, _ = fn(old[rows], new[rows], adv[rows], mask[rows], loss_agg, cfg)
        total = total + part / 2
    (split_grad,) = torch.autograd.grad(total, new)
    assert_close(full, total)
    assert_close(full_grad, split_grad)
