"""The local mode's compute precision on the CPU at hand (``maspo.local_dtype``).

verl computes the actor in bf16 (FSDP's mixed precision, ``param_dtype``) and its vLLM rollout samples in bf16, as
a GPU does fastest. A CPU without native bf16 arithmetic (x86 without AVX512_BF16 or AMX; most laptops, many login
nodes) emulates it: on an AVX2-only AMD EPYC a one-thread matmul ran at 9.4 GFLOP/s in bf16 against 87.6 in fp32,
and SmolLM2's step took 640-706 s in bf16 against 84 s in fp32 on the same loaded machine.

``maspo.local_dtype``: ``auto`` (the default) computes in bf16 where the CPU has it natively, else in fp32, said in
one line; ``bf16`` or ``fp32`` choose. It sets the actor's and the reference policy's ``param_dtype`` and the
engine's ``dtype``; each of those given on the command line wins for its part.
"""

from __future__ import annotations

import functools
import time

SETTING = "maspo.local_dtype"
CHOICES = ("auto", "bf16", "fp32")
# the precision's name in each place it is set: (key, {choice: value})
ACTOR = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
REF = "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype"
ENGINE = "actor_rollout_ref.rollout.dtype"
VALUES = {
    ACTOR: {"bf16": "bf16", "fp32": "fp32"},
    REF: {"bf16": "bf16", "fp32": "fp32"},
    ENGINE: {"bf16": "bfloat16", "fp32": "float32"},
}
# CPU flags of native bf16 arithmetic: x86 (/proc/cpuinfo "flags") and Arm (its "Features")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# without flags to read: native where a bf16 matmul takes less than this many times the fp32 one (emulated: ~10x)
NATIVE_SLOWDOWN = 2.0
CPUINFO = "/proc/cpuinfo"


def read_cpuinfo() -> str | None:
    """``/proc/cpuinfo``'s text; None where there is none to read."""
    try:
        with open(CPUINFO) as f:
            return f.read()
    except OSError:
        return None


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name (x86 ``model name``, Arm's ``Hardware``), else the machine type."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo() or ""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("model name", "hardware") and value.strip():
            return value.strip()
    import platform

    return platform.machine() or "unknown CPU"


def cpu_flags(cpuinfo: str) -> set[str] | None:
    """The flags of the first processor in ``cpuinfo`` (x86 ``flags``, Arm ``Features``); None where it lists none."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return None


def measured_slowdown(size: int = 128, repeats: int = 5) -> float:
    """How many times longer a ``size``-square bf16 matmul takes than the fp32 one on one thread here (the best of
    ``repeats`` each; one thread: two threads of a loaded machine wait on each other longer than the product takes)."""
    import torch

    def best(dtype) -> float:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best(torch.bfloat16) / max(best(torch.float32), 1e-9)
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def native_bf16() -> tuple[bool, str]:
    """(whether this CPU computes bf16 natively, how that is known): its flags, else a measured matmul."""
    cpuinfo = read_cpuinfo()
    return judge(None if cpuinfo is None else cpu_flags(cpuinfo))


def judge(flags: set[str] | None, slowdown=measured_slowdown) -> tuple[bool, str]:
    """``native_bf16`` from the CPU's ``flags`` (None: unknown, then ``slowdown()`` measures)."""
    if flags is not None:
        found = [flag for flag in BF16_FLAGS if flag in flags]
        if found:
            return True, f"its flags include {', '.join(found)}"
        return False, f"its flags include none of {', '.join(BF16_FLAGS)}"
    ratio = slowdown()
    said = f"a bf16 matmul took {ratio:.1f}x the fp32 one here"
    return ratio < NATIVE_SLOWDOWN, said


def given_keys(overrides) -> set[str]:
    """The config keys a list of Hydra command-line overrides sets (``+``, ``++`` and ``~`` stripped)."""
    keys = set()
    for override in overrides or ():
        key, sep, _ = str(override).partition("=")
        if sep:
            keys.add(key.lstrip("+~").strip())
    return keys


def command_line() -> list[str]:
    """The run's command-line overrides (Hydra's), [] where Hydra did not start the run."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        return []


def check_setting(config) -> str:
    from maspo_verl.validation import check_choice

    value = (config.get("maspo", {}) or {}).get("local_dtype", "auto")
    check_choice(SETTING, value, CHOICES)
    return value


def fit(config, overrides=None, native=None) -> str | None:
    """Set the run's precision (``maspo.local_dtype``) on the composed config, each key the command line
    (``overrides``: Hydra's by default) does not set itself; returns the line to print where ``auto`` chose fp32
    (None otherwise). ``native``: what tells whether the CPU has native bf16 (``native_bf16`` by default)."""
    from omegaconf import OmegaConf, open_dict

    setting = check_setting(config)
    why = None
    if setting == "auto":
        has_it, why = (native or native_bf16)()
        setting = "bf16" if has_it else "fp32"
    given = given_keys(command_line() if overrides is None else overrides)
    changed = []
    with open_dict(config):
        for key, values in VALUES.items():
            if any(key == g or key.startswith(g + ".") for g in given):  # the key, or a section holding it
                continue
            section, _, name = key.rpartition(".")
            if key != ENGINE and OmegaConf.select(config, section) is None:
                OmegaConf.update(config, section, {}, force_add=True)  # verl's default: mixed_precision null
            OmegaConf.update(config, key, values[setting], force_add=True)
            changed.append(key)
    if why is None or setting != "fp32" or not changed:
        return None
    parts = [p for p, keys in (("the actor", (ACTOR, REF)), ("the engine", (ENGINE,))) if set(keys) & set(changed)]
    verb = "computes" if len(parts) == 1 else "compute"
    return (
        f"maspo_verl local: this CPU has no native bf16 ({why}): {' and '.join(parts)} {verb} in fp32, several times "
        f"faster here ({SETTING}=bf16 computes in bf16)"
    )
