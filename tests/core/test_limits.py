"""The limits of docs/algorithms.md §5 in float64, against the installed verl's own losses and
independent loop references."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from maspo_verl.batch import WORD_IDS_KEY, micro_batch_scope
from maspo_verl.core.segments import RESPONSE_IDS, SEGMENT_RULES, TOKENIZER
from maspo_verl.core.token_sets import inputs_needed
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
            reads_ids = RESPONSE_IDS in inputs_needed(actor_config(segment_rule=rule.name).policy_loss)
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


# ---- surrogates (maspo_verl.core.surrogates): CISPO and SAPO on any token set ----


def verl_agg_mode(name: str, agg: str) -> str:
    """The aggregation verl's loss ``name`` really applies when asked for ``agg`` (``gspo_agg_mode``, any loss)."""
    old, new, adv, mask = random_batch(scale=0.05, seed=99)
    config = actor_config(loss_mode="vanilla")
    asked = get_policy_loss_fn(name)(old, new, adv, mask, "token-sum", config)[0]
    fixed = get_policy_loss_fn(name)(old, new, adv, mask, "seq-mean-token-mean", config)[0]
    return "seq-mean-token-mean" if torch.equal(asked, fixed) else agg


def need_verl_loss(name: str) -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if name not in POLICY_LOSS_REGISTRY:
        pytest.skip(f"the installed verl has no {name!r} policy loss")


def with_actor(config, **actor):
    """``config`` with other actor fields (verl's ``tau_pos``/``tau_neg``), rebuilt and checked by verl."""
    import dataclasses

    return dataclasses.replace(config, **actor)


# non-default settings in verl's actor fields: they must reach our surrogate as they reach verl's loss
CISPO_CLIPS = {"clip_low": 0.15, "clip_high": 0.35}
SAPO_TAUS = {"tau_pos": 1.4, "tau_neg": 2.5}


def sapo_saturation(new, old, adv, mask, tau_pos, tau_neg) -> float:
    """Share of tokens whose gate passes less than half of the unclipped gradient: 4 s (1 - s) < 1/2."""
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    s = torch.sigmoid(tau * (torch.exp(new.detach() - old) - 1))
    return ((4 * s * (1 - s) < 0.5) & mask).sum().item() / mask.sum().item()


def window_one_inputs(seed, weight_seed, scale, per_token, weighted, agg):
    """A batch, rollout-correction weights (or None), our ``agg_mode`` fields and the aggregation both losses are
    called with: agg_mode=seg-mean-token-mean at W = 1 is verl's seq-mean-token-mean."""
    old, new, adv, mask = random_batch(scale=scale, seed=seed, per_token=per_token)
    weights = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(weight_seed)) * 2
    segment = {"agg_mode": agg} if agg == "seg-mean-token-mean" else {}
    return (old, new, adv, mask), weights if weighted else None, segment, "seq-mean-token-mean" if segment else agg


@pytest.mark.parametrize("agg", [*AGG_MODES, "seg-mean-token-mean"])
@pytest.mark.parametrize("scale", [0.05, 0.6])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_window_one_cispo_is_verl_cispo(agg, scale, per_token, weighted):
    """surrogate=cispo at W = 1 with the actor's clip_ratio_low/high: verl's cispo, in every aggregation
    (agg_mode=seg-mean-token-mean at W = 1 is seq-mean-token-mean), rollout-correction weights included."""
    need_verl_loss("cispo")
    (old, new, adv, mask), weights, segment, verl_agg = window_one_inputs(11, 3, scale, per_token, weighted, agg)
    ours_cfg = actor_config(**CISPO_CLIPS, segment_rule="fixed", segment_window=1, surrogate="cispo", **segment)
    verl_cfg = actor_config(**CISPO_CLIPS, loss_mode="vanilla")
    ours, ours_m = get_policy_loss_fn("maspo")(old, new, adv, mask, verl_agg, ours_cfg, weights)
    verl, verl_m = get_policy_loss_fn("cispo")(old, new, adv, mask, verl_agg, verl_cfg, weights)
    assert_close(ours, verl)
    assert_close(*(torch.autograd.grad(loss, new)[0] for loss in (ours, verl)))
    assert ours_m["actor/pg_clipfrac"] == pytest.approx(verl_m["actor/pg_clipfrac"], abs=1e-6)
    assert ours_m["actor/ppo_kl"] == pytest.approx(verl_m["actor/ppo_kl"], abs=1e-9)
    assert ours_m["actor/pg_clipfrac_lower"] == 0.0
    if scale > 0.5:  # weights clipped on both sides
        assert ours_m["actor/ratio/clipfrac_low"] > 0 and ours_m["actor/ratio/clipfrac_high"] > 0


@pytest.mark.parametrize("agg", [*AGG_MODES, "seg-mean-token-mean"])
@pytest.mark.parametrize("scale", [0.05, 0.6, 3.0])
@pytest.mark.parametrize("per_token", [False, True])
def test_window_one_sapo_is_verl_sapo(agg, scale, per_token):
    """surrogate=sapo at W = 1 with the actor's tau_pos/tau_neg: verl's sapo, in the aggregation verl's
    applies (it always uses seq-mean-token-mean; ours follows loss_agg_mode, or agg_mode)."""
    need_verl_loss("sapo")
    old, new, adv, mask = random_batch(scale=scale, seed=12, per_token=per_token)
    weights = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 2
    segment = {"agg_mode": agg} if agg == "seg-mean-token-mean" else {}
    verl_agg = "seq-mean-token-mean" if segment else agg
    ours_cfg = with_actor(
        actor_config(segment_rule="fixed", segment_window=1, surrogate="sapo", **segment), **SAPO_TAUS
    )
    verl_cfg = with_actor(actor_config(loss_mode="vanilla"), **SAPO_TAUS)
    ours_agg = "seq-mean-token-mean" if segment else verl_agg_mode("sapo", verl_agg)
    ours, ours_m = get_policy_loss_fn("maspo")(old, new, adv, mask, ours_agg, ours_cfg, weights)
    verl, verl_m = get_policy_loss_fn("sapo")(old, new, adv, mask, verl_agg, verl_cfg, weights)
    assert_close(ours, verl)
    assert_close(*(torch.autograd.grad(loss, new)[0] for loss in (ours, verl)))
    assert ours_m["actor/ppo_kl"] == pytest.approx(verl_m["actor/ppo_kl"], abs=1e-9)
    # verl's sapo reports no clip fraction; ours is the gate's saturation
    expected = sapo_saturation(new, old, adv, mask, **SAPO_TAUS)
    assert ours_m["actor/pg_clipfrac"] == pytest.approx(expected, abs=1e-12)
    assert ours_m["actor/pg_clipfrac_lower"] == 0.0
    if scale > 1:
        assert expected > 0


def test_sapo_follows_loss_agg_mode():
    """Unlike verl's sapo, ours aggregates as asked: token-mean differs from seq-mean-token-mean."""
    old, new, adv, mask = random_batch(scale=0.3, seed=13)
    cfg = actor_config(segment_rule="fixed", segment_window=1, surrogate="sapo")
    a = get_policy_loss_fn("maspo")(old, new, adv, mask, "token-mean", cfg)[0]
    b = get_policy_loss_fn("maspo")(old, new, adv, mask, "seq-mean-token-mean", cfg)[0]
    expected = -((4 / torch.where(adv > 0, 1.0, 1.05)) * torch.sigmoid(
        torch.where(adv > 0, 1.0, 1.05) * (torch.exp(new - old) - 1)) * adv * mask).sum() / mask.sum()  # fmt: skip
    assert_close(a, expected)
    assert (a - b).abs() > 1e-3


def sequence_level(kind: str, old, new, adv, mask, low=0.2, high=0.28, tau_pos=1.0, tau_neg=1.05):
    """The sequence-level objectives on GSPO's length-normalised ratio s = exp(mean_t (log pi - log pi_old)),
    written out with autograd through s (no stop-gradient form), one advantage per sequence, mean over
    sequences: SAPO -f(s) A; CISPO -sg[clip(s)] A mean_t log pi."""
    lengths = mask.sum(-1)
    mean = lambda x: (x * mask).sum(-1) / lengths  # noqa: E731
    s = torch.exp(mean(new - old))
    a = adv[:, 0]
    if kind == "sapo":
        tau = torch.where(a > 0, tau_pos, tau_neg)
        per_sequence = -(4 / tau) * torch.sigmoid(tau * (s - 1)) * a
    else:
        per_sequence = -torch.clamp(s, 1 - low, 1 + high).detach() * a * mean(new)
    return per_sequence.mean()


@pytest.mark.parametrize("kind", ["cispo", "sapo"])
@pytest.mark.parametrize("loss", [("maspo", {"segment_window": 1000}), ("pgspo", {"loss_mode": "pgspo"})])
@pytest.mark.parametrize("scale", [0.02, 0.3])
def test_whole_response_is_the_sequence_level_formula(kind, loss, scale):
    """W >= T (and P-GSPO's alpha = 1) with seq-mean-token-mean: the sequence-level CISPO / SAPO of
    docs/algorithms.md §2, loss and gradient."""
    name, fields = loss
    old, new, adv, mask = random_batch(scale=scale, seed=14)
    config = actor_config(0.05, 0.08, **fields, surrogate=kind)
    if kind == "sapo":
        config = with_actor(config, **SAPO_TAUS)
    ours, grad, metrics = loss_and_grad(name, config, old, new, adv, mask, "seq-mean-token-mean")
    ref = sequence_level(kind, old, new, adv, mask, 0.05, 0.08, **SAPO_TAUS)
    (ref_grad,) = torch.autograd.grad(ref, new)
    assert_close(ours, ref)
    assert_close(grad, ref_grad)
    assert grad.abs().sum() > 0
    if kind == "cispo" and scale > 0.1:
        assert metrics["actor/pg_clipfrac"] > 0  # some sequence weights clipped


def test_cispo_log_adaptive_clips_the_weight_at_the_segment_bounds():
    """surrogate=cispo with the log_adaptive schedule: the weight is clip(r, exp(-eps_low n^p), exp(eps_high n^p))
    with n the segment size (loop reference, float64)."""
    old, new, adv, mask = random_batch(B=5, T=17, scale=0.3, seed=15, per_token=True)
    window, eps, p = 4, 0.2, -0.5
    config = actor_config(
        segment_window=window, surrogate="cispo", clip_schedule="log_adaptive",
        log_clip_low=eps, log_clip_high=eps, clip_exponent=p,
    )  # fmt: skip
    loss, grad, metrics = loss_and_grad("maspo", config, old, new, adv, mask, "token-sum")
    ref, clipped = 0.0, 0
    for i in range(mask.shape[0]):
        positions = [t for t in range(mask.shape[1]) if mask[i, t]]
        for k, t in enumerate(positions):
            members = positions[(k // window) * window : (k // window + 1) * window]
            r = math.exp(sum(new[i, u].item() - old[i, u].item() for u in members) / len(members))
            bound = eps * len(members) ** p
            w = min(max(r, math.exp(-bound)), math.exp(bound))
            clipped += w != r
            ref = ref - w * adv[i, t] * new[i, t]
    (ref_grad,) = torch.autograd.grad(ref, new)
    assert_close(loss, ref)
    assert_close(grad, ref_grad)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipped / mask.sum().item())
    assert clipped > 0


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("scale", [0.05, 0.6])
@pytest.mark.parametrize("weighted", [False, True])
def test_window_one_tis_is_verl_dppo_tv_without_its_tv_mask(agg, scale, weighted):
    """surrogate=tis at W = 1: verl's dppo_tv (-A sg[min(r, clip_ratio_c)] log pi) when its TV thresholds never
    bind (|pi - pi_old| <= 1 <= clip_ratio_low/high), loss, gradient and truncated share."""
    need_verl_loss("dppo_tv")
    old, new, adv, mask = random_batch(scale=scale, seed=14, per_token=True)
    weights = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 2
    weights = weights if weighted else None
    clips = {"clip_low": 1.0, "clip_high": 1.0, "clip_c": 1.3}
    ours_cfg = actor_config(**clips, segment_rule="fixed", segment_window=1, surrogate="tis")
    verl_cfg = actor_config(**clips, loss_mode="vanilla")
    ours, ours_m = get_policy_loss_fn("maspo")(old, new, adv, mask, agg, ours_cfg, weights)
    verl, verl_m = get_policy_loss_fn("dppo_tv")(old, new, adv, mask, agg, verl_cfg, weights)
    assert_close(ours, verl)
    assert_close(*(torch.autograd.grad(loss, new)[0] for loss in (ours, verl)))
    # verl counts the truncated tokens as pg_clipfrac_lower; ours as clipfrac_high
    assert ours_m["actor/ratio/clipfrac_high"] == pytest.approx(verl_m["actor/pg_clipfrac_lower"], abs=1e-6)
    assert ours_m["actor/ratio/clipfrac_low"] == 0.0 and ours_m["actor/pg_clipfrac_lower"] == 0.0
    if scale > 0.5:
        assert ours_m["actor/ratio/clipfrac_high"] > 0


# ---- DPPO-Binary (TV, KL) and DRO on any token set: verl's dppo_tv / dppo_kl / dro at one token per set ----

# the actor's clip_ratio_low/high are DPPO's divergence bounds (binding at scale 0.6), clip_ratio_c its truncation
DPPO_BOUNDS = {
    "dppo_tv": {"clip_low": 0.1, "clip_high": 0.15, "clip_c": 1.5},
    "dppo_kl": {"clip_low": 0.02, "clip_high": 0.03, "clip_c": 1.5},
}
DRO_BETA = 0.7


def limits_to_1e12(ours, verl, new):
    assert_close(ours, verl, 1e-12)
    grads = [torch.autograd.grad(loss, new)[0] for loss in (ours, verl)]
    assert_close(*grads, 1e-12)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("agg", [*AGG_MODES, "seg-mean-token-mean"])
@pytest.mark.parametrize("scale", [0.05, 0.6])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_window_one_dppo_is_verl_dppo(name, agg, scale, per_token, weighted):
    """surrogate=dppo_tv / dppo_kl at W = 1 with the actor's clip_ratio_low/high as divergence bounds and clip_ratio_c
    as the truncation: verl's dppo_tv / dppo_kl, loss and gradient within 1e-12 in every aggregation (agg_mode=
    seg-mean-token-mean at W = 1 is seq-mean-token-mean), rollout-correction weights included; the masked share is
    verl's pg_clipfrac, the truncated share of the kept tokens its pg_clipfrac_lower."""
    need_verl_loss(name)
    (old, new, adv, mask), weights, segment, verl_agg = window_one_inputs(31, 6, scale, per_token, weighted, agg)
    bounds = DPPO_BOUNDS[name]
    ours_cfg = actor_config(**bounds, segment_rule="fixed", segment_window=1, surrogate=name, **segment)
    ours, ours_m = get_policy_loss_fn("maspo")(old, new, adv, mask, verl_agg, ours_cfg, weights)
    verl_cfg = actor_config(**bounds, loss_mode="vanilla")
    verl, verl_m = get_policy_loss_fn(name)(old, new, adv, mask, verl_agg, verl_cfg, weights)
    limits_to_1e12(ours, verl, new)
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):  # verl's shares are float32
        assert ours_m[key] == pytest.approx(verl_m[key], abs=1e-6), key
    assert ours_m["actor/ppo_kl"] == pytest.approx(verl_m["actor/ppo_kl"], abs=1e-12)
    if scale > 0.5:  # masked on both sides, and truncated
        assert ours_m["actor/ratio/clipfrac_low"] > 0 and ours_m["actor/ratio/clipfrac_high"] > 0
        assert ours_m["actor/ratio/clipfrac_dual"] > 0


@pytest.mark.parametrize("agg", [*AGG_MODES, "seg-mean-token-mean"])
@pytest.mark.parametrize("scale", [0.05, 0.6])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_window_one_dro_is_verl_dro(agg, scale, per_token, weighted):
    """surrogate=dro at W = 1 with verl's policy_loss.dro_beta: verl's dro, loss and gradient within 1e-12 in every
    aggregation, rollout-correction weights included; nothing reported as clipped."""
    need_verl_loss("dro")
    (old, new, adv, mask), weights, segment, verl_agg = window_one_inputs(32, 7, scale, per_token, weighted, agg)
    ours_cfg = actor_config(segment_rule="fixed", segment_window=1, surrogate="dro", dro_beta=DRO_BETA, **segment)
    verl_cfg = actor_config(loss_mode="vanilla", dro_beta=DRO_BETA)
    ours, ours_m = get_policy_loss_fn("maspo")(old, new, adv, mask, verl_agg, ours_cfg, weights)
    verl, verl_m = get_policy_loss_fn("dro")(old, new, adv, mask, verl_agg, verl_cfg, weights)
    limits_to_1e12(ours, verl, new)
    assert ours_m["actor/ppo_kl"] == pytest.approx(verl_m["actor/ppo_kl"], abs=1e-12)
    assert ours_m["actor/pg_clipfrac"] == 0.0 and ours_m["actor/pg_clipfrac_lower"] == 0.0


def sequence_level_dppo_dro(kind, old, new, adv, mask, low, high, c, beta):
    """DPPO-Binary and DRO at the sequence level, written out with autograd (no stop-gradient form), one advantage
    per sequence, mean over sequences. With the length-normalised log-ratio m = mean_t (log pi - log pi_old), GSPO's
    ratio s = exp(m) is the ratio of the geometric-mean probabilities p = exp(mean_t log pi_old), p' = exp(mean_t
    log pi): DPPO keeps the sequence where A > 0 and D(p, p') <= high or p' <= p, where A <= 0 and D <= low or
    p' >= p (TV: D = |p' - p|; KL: the binary KL), loss -sg[min(s, c)] A mean_t log pi there; DRO: -A mean_t log pi
    + beta m^2 / 2."""
    lengths = mask.sum(-1)
    mean = lambda x: (x * mask).sum(-1) / lengths  # noqa: E731
    m = mean(new - old)
    a = adv[:, 0]
    if kind == "dro":
        return (-a * mean(new) + 0.5 * beta * m**2).mean()
    p, p_new = torch.exp(mean(old)), torch.exp(mean(new)).detach()
    if kind == "dppo_tv":
        rose_ok, fell_ok = p_new - p <= high, p_new - p >= -low
    else:
        kl = p * torch.log(p / p_new) + (1 - p) * torch.log((1 - p + 1e-8) / (1 - p_new + 1e-8))
        rose_ok, fell_ok = (kl <= high) | (p_new <= p), (kl <= low) | (p_new >= p)
    kept = torch.where(a > 0, rose_ok, fell_ok)
    weight = torch.clamp(torch.exp(m), max=c).detach() * kept
    return (-weight * a * mean(new)).mean(), kept


@pytest.mark.parametrize("kind", ["dppo_tv", "dppo_kl", "dro"])
@pytest.mark.parametrize("loss", [("maspo", {"segment_window": 1000}), ("pgspo", {"loss_mode": "pgspo"})])
@pytest.mark.parametrize("scale", [0.02, 0.3])
def test_whole_response_is_the_sequence_level_dppo_and_dro(kind, loss, scale):
    """W >= T (and P-GSPO's alpha = 1) with seq-mean-token-mean: the sequence-level DPPO-Binary on the geometric-mean
    probability and DRO on the length-normalised log-ratio (docs/algorithms.md §2), loss and gradient."""
    name, fields = loss
    old, new, adv, mask = random_batch(scale=scale, seed=33)
    low, high = (0.01, 0.015) if kind == "dppo_tv" else (0.0004, 0.0006)
    c, beta = 1.05, 2.0
    extra = {"dro_beta": beta} if kind == "dro" else {}
    config = actor_config(low, high, c, **fields, surrogate=kind, **extra)
    ours, grad, metrics = loss_and_grad(name, config, old, new, adv, mask, "seq-mean-token-mean")
    ref = sequence_level_dppo_dro(kind, old, new, adv, mask, low, high, c, beta)
    ref, kept = ref if kind != "dro" else (ref, None)
    (ref_grad,) = torch.autograd.grad(ref, new)
    assert_close(ours, ref, 1e-12)
    assert_close(grad, ref_grad, 1e-12)
    assert grad.abs().sum() > 0
    if kept is not None and scale > 0.1:  # some sequences masked, some kept
        assert not kept.all() and kept.any()
        assert metrics["actor/pg_clipfrac"] > 0
