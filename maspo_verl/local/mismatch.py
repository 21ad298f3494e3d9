"""A test instrument of the local mode: a controlled training-inference mismatch in the HF rollout server.

Off by default. ``maspo.local_mismatch`` (``local=cpu``) has two keys:

- ``logprob_dtype``: ``fp32`` (default) or ``bf16``. With ``bf16`` the server's model runs in bfloat16
  (it samples from, and returns the log-probs of, the bf16 forward; log-softmax in fp32), as an
  inference engine in bf16 does, while the trainer's actor stays in fp32.
- ``noise_std``: sigma >= 0 (default 0). Each returned log-prob gets independent Gaussian noise
  N(0, sigma^2) after sampling (the tokens drawn do not change; the noise has its own generator).
- ``stale_syncs``: k >= 0 (default 0). The server applies each weight sync k syncs late (a stale copy of
  the policy, as an asynchronous rollout has): it samples from, and returns the log-probs of, the
  policy of k updates ago (its initial weights until then).

``logprob_dtype=bf16`` and ``stale_syncs`` make the rollout a different *policy* (tokens are sampled from
it), the real mismatch verl's decoupled-mode rollout correction corrects; ``noise_std`` changes only the
reported log-probs.

The trainer's actor is fp32 only with ``actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32``:
verl's default FSDP mixed precision computes its forward in bf16, a bf16-sized mismatch of its own in
bypass mode (``python -m maspo_verl.lab learn --fp32-trainer`` sets it).

Only the log-probs the server *returns* change. With ``algorithm.rollout_correction.bypass_mode=true``
they are verl's old log-probs, so a token's first-update ratio is exp(trainer - server): the mismatch
is what the loss sees. Without bypass mode verl recomputes the old log-probs and the returned ones
only feed verl's rollout-correction diagnostics.

The driver validates the section at start-up (``from_mapping``) and forwards it to the server (a
Ray actor) in ``MISMATCH_ENV`` (JSON), which the server reads with ``from_env``.
No verl, no torch here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from maspo_verl.validation import check_choice, check_float, check_int, reject_unknown

SECTION = "maspo.local_mismatch"
MISMATCH_ENV = "MASPO_VERL_HF_MISMATCH"
LOGPROB_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class LogProbMismatch:
    logprob_dtype: str = "fp32"
    noise_std: float = 0.0
    stale_syncs: int = 0

    def __post_init__(self):
        check_choice(f"{SECTION}.logprob_dtype", self.logprob_dtype, LOGPROB_DTYPES)
        check_float(f"{SECTION}.noise_std", self.noise_std, 0.0)
        check_int(f"{SECTION}.stale_syncs", self.stale_syncs, 0)
        object.__setattr__(self, "noise_std", float(self.noise_std))

    @property
    def active(self) -> bool:
        return self.logprob_dtype != "fp32" or self.noise_std > 0 or self.stale_syncs > 0

    @classmethod
    def from_mapping(cls, values: Mapping | None) -> LogProbMismatch:
        values = dict(values or {})
        reject_unknown(SECTION, values, [f.name for f in fields(cls)])
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LogProbMismatch:
        raw = (os.environ if environ is None else environ).get(MISMATCH_ENV, "")
        if not raw.strip():
            return cls()
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{MISMATCH_ENV}={raw!r} is not JSON ({exc}); set {SECTION}.* instead") from exc
        return cls.from_mapping(values)

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def describe(self) -> str:
        parts = [f"log-probs in {self.logprob_dtype}"] + [f"noise sigma {self.noise_std:g}"] * (self.noise_std > 0)
        parts += [f"weights {self.stale_syncs} sync(s) stale"] * (self.stale_syncs > 0)
        return ", ".join(parts)
