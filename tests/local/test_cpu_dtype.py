"""The local mode's precision for the CPU at hand (``maspo_verl.local.cpu_dtype``): a CPU with native bf16 and one
without (their /proc/cpuinfo, or a measured matmul where no flags are listed), ``maspo.local_dtype`` and the
command-line overrides that win over it."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from maspo_verl.local import cpu_dtype
from maspo_verl.local.cpu_dtype import ACTOR, ENGINE, REF
from maspo_verl.validation import FieldError
from tests.helpers import compose_config

# the first processor of /proc/cpuinfo on three machines (flags shortened)
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 sha_ni
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve bf16 i8mm
"""


def _native(flags):
    return lambda: cpu_dtype.judge(flags)


WITHOUT = _native(cpu_dtype.cpu_flags(EPYC_AVX2))
WITH = _native(cpu_dtype.cpu_flags(SAPPHIRE_RAPIDS))


def test_flags_say_which_cpu_has_native_bf16():
    assert cpu_dtype.judge(cpu_dtype.cpu_flags(EPYC_AVX2)) == (
        False, "its flags include none of avx512_bf16, amx_bf16, bf16"
    )  # fmt: skip
    assert cpu_dtype.judge(cpu_dtype.cpu_flags(SAPPHIRE_RAPIDS)) == (True, "its flags include avx512_bf16, amx_bf16")
    assert cpu_dtype.judge(cpu_dtype.cpu_flags(GRAVITON3)) == (True, "its flags include bf16")
    assert cpu_dtype.cpu_flags("processor\t: 0\nmodel name\t: Apple M2\n") is None


def test_without_flags_a_measured_matmul_decides():
    assert cpu_dtype.judge(None, slowdown=lambda: 9.3) == (False, "a bf16 matmul took 9.3x the fp32 one here")
    assert cpu_dtype.judge(None, slowdown=lambda: 0.6)[0] is True


def test_the_measurement_agrees_with_this_cpus_flags():
    """The fallback measures what the flags say (emulated bf16 is ~10x slower than fp32; native, faster)."""
    flags = cpu_dtype.cpu_flags(open(cpu_dtype.CPUINFO).read()) if os.path.exists(cpu_dtype.CPUINFO) else None
    if flags is None:
        pytest.skip("no CPU flags to compare with here")
    assert cpu_dtype.judge(None)[0] == cpu_dtype.judge(flags)[0], cpu_dtype.measured_slowdown()


def _config(*overrides):
    return compose_config("local=cpu", *overrides)


def _dtypes(config):
    return tuple(OmegaConf.select(config, key) for key in (ACTOR, REF, ENGINE))


def test_auto_computes_in_fp32_on_a_cpu_without_native_bf16_and_says_so():
    config = _config()
    line = cpu_dtype.fit(config, [], native=WITHOUT)
    assert _dtypes(config) == ("fp32", "fp32", "float32")
    assert line == (
        "maspo_verl local: this CPU has no native bf16 (its flags include none of avx512_bf16, amx_bf16, bf16): "
        "the actor and the engine compute in fp32, several times faster here (maspo.local_dtype=bf16 computes in bf16)"
    )
    # verl's other mixed-precision defaults stay as they were (reduce and buffers in fp32)
    assert set(config.actor_rollout_ref.actor.fsdp_config.mixed_precision) == {"param_dtype"}


def test_auto_keeps_bf16_on_a_cpu_with_it_and_says_nothing():
    config = _config()
    assert cpu_dtype.fit(config, [], native=WITH) is None
    assert _dtypes(config) == ("bf16", "bf16", "bfloat16")


@pytest.mark.parametrize("setting", ["bf16", "fp32"])
@pytest.mark.parametrize("native", [WITH, WITHOUT], ids=["native", "emulated"])
def test_a_chosen_precision_holds_on_either_cpu(setting, native):
    config = _config(f"maspo.local_dtype={setting}")
    assert cpu_dtype.fit(config, [f"maspo.local_dtype={setting}"], native=native) is None
    assert _dtypes(config) == ((setting, setting, {"bf16": "bfloat16", "fp32": "float32"}[setting]))


def test_the_command_lines_own_precision_wins():
    given = [f"++{ACTOR}=bf16", f"{ENGINE}=bfloat16"]
    config = _config(*given)
    line = cpu_dtype.fit(config, given, native=WITHOUT)
    assert _dtypes(config) == ("bf16", "fp32", "bfloat16")  # the reference policy follows auto
    assert "the actor computes in fp32" in line and "engine" not in line.split("):")[1]
    engine_only = [f"{ENGINE}=bfloat16"]
    config = _config(*engine_only)
    line = cpu_dtype.fit(config, engine_only, native=WITHOUT)
    assert _dtypes(config) == ("fp32", "fp32", "bfloat16") and ": the actor computes in fp32" in line
    both = [f"++{ACTOR}=bf16", f"++{REF}=bf16", f"{ENGINE}=bfloat16"]
    config = _config(*both)
    assert cpu_dtype.fit(config, both, native=WITHOUT) is None  # nothing left to say
    section = ["++actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:bf16}"]
    config = _config(*section)
    cpu_dtype.fit(config, section, native=WITHOUT)
    assert _dtypes(config)[0] == "bf16"  # a section holding the key is the key given


def test_given_keys_strip_hydras_prefixes():
    assert cpu_dtype.given_keys(["++a.b=1", "+c=2", "~d=3", "e.f=x=y", "noequals"]) == {"a.b", "c", "d", "e.f"}


def test_a_bad_setting_is_refused_naming_the_choices():
    with pytest.raises(FieldError, match=r"maspo.local_dtype='fp16' is invalid: allowed one of auto, bf16, fp32"):
        cpu_dtype.fit(_config("maspo.local_dtype=fp16"), [])
