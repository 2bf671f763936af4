"""``precision.schedule``: parsing ``--precision-schedule``, every refusal (one line naming the flag),
phase boundaries, and the round trips checkpoints rely on."""

import pytest

from precision import SpecError, presets
from precision.schedule import OBSERVE, Phase, PrecisionSchedule

FLAG = "--precision-schedule"


def test_phases_of_a_schedule():
    s = PrecisionSchedule.parse("0:fp8,200:wgrad_hadamard,900:bf16")
    assert s.phases == (Phase(0, "fp8"), Phase(200, "wgrad_hadamard"), Phase(900, "bf16"))
    assert str(s) == "0:fp8,200:wgrad_hadamard,900:bf16" and len(s) == 3


def test_per_gemm_specs_keep_their_commas():
    # a new phase begins only at a top-level comma followed by DIGITS: (a spec's own commas and
    # those inside delayed(...) stay with it); spaces around starts are allowed
    s = PrecisionSchedule.parse("0:fprop=hif8+delayed(max,64),dgrad=bf16,wgrad=bf16 , 5 : base=fp8,wgrad=mxfp4+had16")
    assert s.phases == (Phase(0, "fprop=hif8+delayed(max,64),dgrad=bf16,wgrad=bf16"),
                        Phase(5, "base=fp8,wgrad=mxfp4+had16"))
    assert PrecisionSchedule.parse(str(s)) == s


def test_a_spec_file_is_a_phase(tmp_path):
    spec = tmp_path / "wgrad_bf16.yaml"
    spec.write_text("base: mxfp4\nwgrad: bf16\n")
    s = PrecisionSchedule.parse(f"0:bf16,10:{spec}")
    assert s.phases[1] == Phase(10, str(spec))


def test_phase_at_boundaries():
    # START:P trains iteration START+1 first: phase_at(k) is the phase of the step taken when k
    # iterations are done (log iteration k + 1)
    s = PrecisionSchedule.parse("0:fp8,200:wgrad_hadamard,900:bf16")
    assert [s.index_at(k) for k in (0, 1, 199, 200, 201, 899, 900, 10**6)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert s.phase_at(199) == Phase(0, "fp8") and s.phase_at(200) == Phase(200, "wgrad_hadamard")
    assert s.iterations(0, 1000) == (1, 200) and s.iterations(1, 1000) == (201, 900)
    assert s.iterations(2, 1000) == (901, 1000)
    with pytest.raises(ValueError, match="iteration -1: must be >= 0"):
        s.index_at(-1)


def test_observe_holds_the_next_phase_plan():
    s = PrecisionSchedule.parse("0:observe,500:hif8_w8a8,900:bf16")
    assert s.phases[0].observe and not s.phases[1].observe
    assert [s.plan_index(k) for k in range(3)] == [1, 1, 2]
    assert "phase 0 observe for phase 1 (iterations 1..500)" in s.describe(1000)


def test_qat_warmup_is_a_schedule():
    assert PrecisionSchedule.qat_warmup(500, "hif8_w8a8") == PrecisionSchedule.parse("0:observe,500:hif8_w8a8")
    assert PrecisionSchedule.qat_warmup(0, "mxfp4") == PrecisionSchedule.single("mxfp4")
    assert PrecisionSchedule.single("mxfp4").phases == (Phase(0, "mxfp4"),)
    with pytest.raises(SpecError, match=r"^--qat-warmup-iters -1: must be >= 0$"):
        PrecisionSchedule.qat_warmup(-1, "fp8")


def test_dict_round_trip():
    s = PrecisionSchedule.parse("0:observe,3:base=fp8,wgrad=mxfp4+had16,7:bf16")
    d = s.to_dict()
    assert d == {"phases": [{"start": 0, "precision": OBSERVE}, {"start": 3, "precision": "base=fp8,wgrad=mxfp4+had16"},
                            {"start": 7, "precision": "bf16"}]}
    assert PrecisionSchedule.from_dict(d) == s
    with pytest.raises(SpecError, match="expected {'phases': \\[...\\]}"):
        PrecisionSchedule.from_dict({"phases": [], "extra": 1})
    with pytest.raises(SpecError, match="a phase must have exactly start and precision"):
        PrecisionSchedule.from_dict({"phases": [{"start": 0, "precision": "fp8", "rules": []}]})


def test_construction_validates_too():
    with pytest.raises(SpecError, match="the first phase starts at 3"):
        PrecisionSchedule((Phase(3, "fp8"),))
    with pytest.raises(SpecError, match="no phases"):
        PrecisionSchedule(())


# fmt: off
BAD = [  # (text, the key part of the one line that follows "--precision-schedule 'TEXT': ")
    ("", "empty; expected START:PRECISION,... e.g. 0:fp8,200:wgrad_hadamard,900:bf16"),
    ("fp8", "'fp8' is not START:PRECISION"),
    ("0:fp8,x:bf16", "'x:bf16': START 'x' must be a non-negative integer"),
    ("0:fp8,-5:bf16", "'-5:bf16': START '-5' must be a non-negative integer"),
    ("0:fp8,2.5:bf16", "START '2.5' must be a non-negative integer"),
    ("0:", "phase 0: no precision after '0:'"),
    ("100:fp8,200:bf16", "the first phase starts at 100; it must start at 0 (e.g. 0:fp8)"),
    ("0:fp8,200:bf16,200:mxfp4", "phases 1 (200:bf16) and 2 (200:mxfp4) both start at 200: give each start once"),
    ("0:fp8,300:bf16,200:mxfp4", "phase 2 (200:mxfp4) starts before phase 1 (300:bf16): starts must increase"),
    ("0:fp8,100:fp9", "phase 100:fp9: unknown precision 'fp9': not a preset, a spec (GEMM=RECIPE,...) or a file; "
                      "presets: " + ", ".join(presets.names())),
    ("0:base=nope,wgrad=bf16", "phase 0:base=nope,wgrad=bf16: unknown precision preset 'nope'; valid:"),
    ("0:fprop=mxfp5,dgrad=bf16,wgrad=bf16", "phase 0:fprop=mxfp5,dgrad=bf16,wgrad=bf16: fprop: unknown format"),
    ("0:observe", "the last phase (0:observe) is observe: observe fills the amax histories of the next phase's plan"),
    ("0:fp8,10:observe", "the last phase (10:observe) is observe"),
    ("0:observe,5:observe,9:fp8", "phases 0 (0:observe) and 1 (5:observe) are both observe: merge them into one"),
]
# fmt: on


@pytest.mark.parametrize("text, expected", BAD)
def test_refusals_name_the_flag_in_one_line(text, expected):
    with pytest.raises(SpecError) as exc:
        PrecisionSchedule.parse(text)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"{FLAG} {text!r}: "), msg
    assert expected in msg, msg


def test_another_flag_name_in_messages():
    with pytest.raises(SpecError, match=r"^grid.schedules '1:fp8': the first phase starts at 1"):
        PrecisionSchedule.parse("1:fp8", flag="grid.schedules")


def test_a_phase_that_would_never_run():
    s = PrecisionSchedule.parse("0:nvfp4,900:bf16")
    s.check_train_iters(901)  # iteration 901 runs in BF16
    for train_iters in (900, 500):
        with pytest.raises(SpecError) as exc:
            s.check_train_iters(train_iters)
        assert str(exc.value) == (f"{FLAG} '0:nvfp4,900:bf16': phase 900:bf16 starts after iteration 900, but "
                                  f"--train-iters is {train_iters}: it would never run (starts must be < --train-iters)")
