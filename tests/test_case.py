"""Case ids: canonical, parseable, round-trip exactly, and reject malformed input clearly."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_parity.conformance import ops
from kernel_parity.conformance.case import Case
from kernel_parity.conformance.errors import UsageError
from kernel_parity.property_tests.strategies import cases


@pytest.mark.parametrize("op", sorted(ops.all_specs()))
@settings(max_examples=10)  # a parse of the id the draw prints: 10 draws an op (~100 ops; 30 took 78 s of CI)
@given(data=st.data())
def test_case_id_round_trip(op, data):
    case = data.draw(cases(op, data.draw(st.sampled_from(["triton", "cpu", "torch", "my_kernel-v2"]))))
    parsed = ops.parse_case(case.id)
    assert parsed == case and parsed.id == case.id
    assert all(ch.isalnum() or ch in "/_.,=+-" for ch in case.id)  # shell-safe: no quoting needed


def test_id_is_canonical_whatever_the_input_order_and_alias():
    a = ops.parse_case("softmax.softmax/cpu/float16/pad=0,n=113,rows=3/normal/seed=7")
    assert a.id == "softmax.softmax/cpu/fp16/rows=3,n=113,pad=0/normal/seed=7"


def test_input_key_ignores_the_backend():
    a = ops.parse_case("combine.lse_combine/cpu/bf16/splits=2,rows=3,dv=4/empty/seed=1")
    assert a.input_key == a.with_backend("torch").input_key and a.input_key != a.with_seed(2).input_key


@pytest.mark.parametrize("text, needle", [
    ("softmax.softmax/cpu/fp16/rows=3,n=113,pad=0/normal", "6 fields"),
    ("softmax.softmax/cpu/fp16/rows=3,n=113,pad=0/normal/seed=-1", "seed=N"),
    ("softmax.softmax/cpu/fp16/rows=3,rows=4,n=1,pad=0/normal/seed=1", "given twice"),
    ("softmax.softmax/cpu/fp16/rows=three,n=1,pad=0/normal/seed=1", "not an integer"),
    ("softmax.softmax/cpu/fp16/rows=3,n=1,pad=2/normal/seed=1", "pad='2' is not one of 0, 1, 16"),
    ("softmax.softmax/c pu/fp16/rows=3,n=1,pad=0/normal/seed=1", "bad backend"),
])
def test_malformed_ids(text, needle):
    with pytest.raises(UsageError, match=needle):
        ops.parse_case(text)


def test_make_rejects_unsafe_values():
    with pytest.raises(UsageError, match="not allowed"):
        Case.make("softmax.softmax", "cpu", "fp16", {"rows": "a/b"}, "normal", 0)
