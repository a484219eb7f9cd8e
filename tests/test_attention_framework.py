"""Framework features that the attention family brought: diagnoses, known failures, outputs a
backend does not provide, "any value" outputs, the SDPA plugin's supports() table, the
interpreter fixes."""

import json

import numpy as np
import pytest

from kernel_parity.reports import records
from kernel_parity.conformance import known, ops
from kernel_parity.conformance.backends import Registry
from kernel_parity.conformance.cli import main
from kernel_parity.conformance.errors import UsageError
from kernel_parity.conformance.results import CaseResult
from kernel_parity.conformance.runner import Runner

PREFILL = "attention.prefill/{b}/fp32/b=2,sq=5,sk=9,hq=4,hkv=2,d=16,causal=bottom_right,wl=-1,wr=-1,cap=0,sink=0/normal/seed=0"


@pytest.mark.parametrize("obj, name, label", [
    ("ATTN_TOP_LEFT", "attn_top_left", "matches the other causal alignment: alignment bug"),
    ("ATTN_TILED", "attn_tiled", "matches kv head h % h_kv: GQA head-mapping bug"),
    ("ATTN_NO_SCALE", "attn_no_scale", "matches scale 1 (no 1/sqrt(d)): scale bug"),
])
def test_a_failing_attention_kernel_is_diagnosed(obj, name, label, capsys):
    case_id = PREFILL.format(b=name)
    assert main(["repro", case_id, "--backend", f"tests.third_party:{obj}"]) == 1
    out = capsys.readouterr().out
    assert f"diagnosis: {label}" in out
    rec = Runner(Registry(extra=[f"tests.third_party:{obj}"])).evaluate(ops.parse_case(case_id))
    assert rec.verdict == "fail" and rec.diagnosis[0].startswith(label)
    assert len(rec.diagnosis) == 1  # the other alternatives do not match


def _rec(op, backend, rest, verdict):
    return CaseResult(id=f"{op}/{backend}/{rest}", op=op, backend=backend, dtype="bf16", params={}, dist="normal",
                      seed=0, verdict=verdict, reason="r")


def test_known_failures_xfail_xpass_and_stale():
    entries = [known.Entry("attention.prefill", "sdpa-cudnn", "*/masked*", "bool-mask rows"),
               known.Entry("attention.prefill", "sdpa-cudnn", "fp16/*", "fixed upstream"),
               known.Entry("attention.prefill", "sdpa-cudnn", "bf16/*/nope/*", "matches nothing"),
               known.Entry("attention.decode", "sdpa-flash", "*", "did not run")]
    results = [_rec("attention.prefill", "sdpa-cudnn", "bf16/b=1/masked/seed=0", "fail"),
               _rec("attention.prefill", "sdpa-cudnn", "fp16/b=1/normal/seed=0", "pass"),
               _rec("attention.prefill", "sdpa-math", "bf16/b=1/masked/seed=0", "fail")]
    stale = known.apply(results, entries)
    assert [r.verdict for r in results] == ["xfail", "xpass", "fail"]
    assert results[0].known["verdict"] == "fail"
    assert stale == ["attention.prefill/sdpa-cudnn/bf16/*/nope/*"]  # the decode entry is out of scope


def test_stale_is_judged_only_where_an_entry_could_have_matched():
    """A run narrowed within an op/backend pair (--dtype, --dist, --shard) cannot tell a stale entry
    from one whose cases were filtered out; an entry scoped to suites is judged in runs of those only."""
    entries = [known.Entry("attention.prefill", "sdpa-cudnn", "fp32/*/shifted/*", "fp32 only"),
               known.Entry("attention.prefill", "sdpa-cudnn", "bf16/*/far/*", "ci shapes", suites=("ci",))]
    results = [_rec("attention.prefill", "sdpa-cudnn", "bf16/b=1/normal/seed=0", "pass")]
    both = [e.label for e in entries]
    assert known.stale(results, entries) == both  # no selection known: every unmatched entry
    assert known.stale(results, entries, {"suites": ["ci"]}) == both
    assert known.stale(results, entries, {"suites": ["smoke"]}) == [both[0]]  # the second is ci's
    assert known.stale(results, entries, {"suites": ["/repo/parity/ci.toml"]}) == both  # a path names ci too
    for narrowed in ({"dtypes": ["bf16"]}, {"dists": ["normal"]}, {"shard": [1, 2]}):
        assert known.stale(results, entries, {"suites": ["ci"], **narrowed}) == []


def test_a_known_failures_entry_may_name_its_suites(tmp_path):
    table = tmp_path / "known.toml"
    table.write_text('[[known]]\nop = "a.b"\nbackend = "x"\nmatch = "*"\nreason = "r"\nsuites = ["ci", "models"]\n')
    (entry,) = known.load(table)
    assert entry.suites == ("ci", "models")
    table.write_text('[[known]]\nop = "a.b"\nbackend = "x"\nmatch = "*"\nreason = "r"\nsuites = "ci"\n')
    with pytest.raises(UsageError, match="suites must be a list of suite names"):
        known.load(table)


def test_known_failures_file_drives_the_gate(tmp_path):
    case = "softmax.softmax"
    table = tmp_path / "known.toml"
    table.write_text('[[known]]\nop = "softmax.softmax"\nbackend = "np_noisy"\nmatch = "fp16/*"\n'
                     'reason = "a test entry"\n')
    out = tmp_path / "r.json"
    common = ["gate", "--suite", "smoke", "--op", case, "--backend", "tests.third_party:NOISY", "--no-progress",
              "-q", "--json", str(out), "--known-failures", str(table)]
    assert main(common + ["--dtype", "fp16"]) == 0  # every failure is a listed one
    assert {r["verdict"] for r in records.load(out)["results"]} == {"xfail"}
    assert main(common) == 1  # fp32 and bf16 failures are not listed
    good = ["gate", "--suite", "smoke", "--op", case, "--backend", "tests.third_party:GOOD", "--no-progress", "-q",
            "--known-failures", str(table)]
    table.write_text(table.read_text().replace("np_noisy", "np_good"))
    assert main(good) == 1  # xpass: the entry must go


def test_not_provided_outputs_are_recorded_not_judged():
    registry = Registry()
    case = ops.parse_case(PREFILL.format(b="sdpa-cpu"))
    rec = Runner(registry).evaluate(case)
    assert rec.verdict == "pass"
    assert rec.outputs["lse"].not_provided == "the public SDPA API returns no LSE"
    assert rec.outputs["o"].metrics


@pytest.mark.parametrize("params, reason", [
    ("cap=30,sink=0", "SDPA has no logit softcap"),
    ("cap=0,sink=1", "SDPA has no attention sinks"),
])
def test_sdpa_supports_states_its_limits(params, reason):
    case = ops.parse_case(PREFILL.format(b="sdpa-cpu").replace("cap=0,sink=0", params))
    assert Registry().get("sdpa-cpu").supports(case) == reason


def test_sdpa_gpu_backends_skip_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    for name in ("sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"):
        assert Registry().get(name).available() == f"{name} needs a CUDA GPU"


def test_empty_split_partials_accept_any_value():
    case = ops.parse_case("attention.decode_split/torch/fp32/b=2,sq=1,kv=5,hq=4,hkv=2,d=64,lens=full,splits=16,"
                          "causal=bottom_right,wl=-1,wr=-1,cap=0,sink=0/normal/seed=0")
    runner = Runner()
    runner.capture = {}
    rec = runner.evaluate(case)
    assert rec.verdict == "pass"
    golden = runner.capture[case.id]["golden"]["o_parts"]
    assert np.isnan(golden).any()  # 16 splits over 5 keys: most are empty


def test_triton_interpreter_is_fixed_for_bf16():
    import importlib.util

    if importlib.util.find_spec("triton") is None:  # importing it here would be too early
        pytest.skip("triton is not installed")
    backend = Registry().get("triton")
    if not backend.interpreter:
        pytest.skip("a GPU is present: nothing to fix")
    assert backend.available() is None
    assert "fp32->bf16 rounding fixed" in backend.describe() and "bf16 dot" in backend.describe()
    from kernel_parity.conformance.backends.triton_interpreter import _PROBE_RNE, _probe, _probe_dot

    assert _probe() == _PROBE_RNE and _probe_dot()


def test_triton_interpreter_patches_the_language_once_a_launch_and_restores_it():
    """The preparation's speed-ups (conformance/backends/triton_interpreter.py): a launch patches triton.language
    once, its helper calls do not patch it again, the builtins are the originals after the launch (also after one
    that raised), and the results are the interpreter's own."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    backend = Registry().get("triton")
    if not backend.interpreter:
        pytest.skip("a GPU is present: no interpreter")
    assert backend.available() is None
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as interp

    patch, builtin = interp._patch_lang, interp._patch_builtin
    assert getattr(patch, "_kernel_parity_once", False)
    assert getattr(interp._get_np_dtype, "_kernel_parity_table", False)
    from tests.interp_kernels import helper_kernel

    calls = []
    interp._patch_builtin = lambda *a: (calls.append(1), builtin(*a))[1]
    load = tl.load
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty_like(x)
    try:
        helper_kernel[(2,)](x, y, HELPERS=0, FAIL=False)
        alone = len(calls)
        assert alone > 0 and tl.load is load and torch.equal(y, x)
        helper_kernel[(2,)](x, y, HELPERS=3, FAIL=False)  # 6 helper calls: no patch more than a launch's
        assert len(calls) == 2 * alone
        assert torch.equal(y, ((x * 2 + 1) * 2 + 1) * 2 + 1)
        assert tl.load is load  # restored
        with pytest.raises(Exception):
            helper_kernel[(1,)](x, y, HELPERS=1, FAIL=True)
        assert tl.load is load
        helper_kernel[(2,)](x, y, HELPERS=1, FAIL=False)  # a launch after a failed one patches again
        assert len(calls) == 4 * alone and torch.equal(y, x * 2 + 1)
    finally:
        interp._patch_builtin = builtin
    assert interp._get_np_dtype(tl.bfloat16) == np.dtype(np.uint16)
    assert interp._get_np_dtype(tl.block_type(tl.float32, [4])) == np.dtype(np.float32)
    assert interp._get_np_dtype(tl.pointer_type(tl.float16)) == np.dtype(np.uint64)


def test_triton_imported_before_the_interpreter_flag_is_a_clear_skip():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import triton;"
            "from kernel_parity.conformance.backends import Registry; b = Registry().get('triton');"
            "print(b.available() if b.interpreter else 'gpu')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "gpu" or "imported before TRITON_INTERPRET=1" in r.stdout


def test_defaulted_parameters_keep_the_ids_of_cases_that_predate_them():
    base = ("attention.decode_split/torch/fp32/b=2,sq=1,kv=5,hq=4,hkv=2,d=64,{extra}lens=full,splits=2,{part}"
            "causal=bottom_right,wl=-1,wr=-1,cap=0,sink=0/normal/seed=0")
    plain = base.format(extra="", part="")
    assert ops.parse_case(plain).id == plain
    explicit = base.format(extra="dv=0,vk=0,", part="part=equal,blk=0,")
    assert ops.parse_case(explicit).id == plain  # a default given explicitly is left out of the id
    new = base.format(extra="dv=32,vk=1,", part="part=block,blk=4,")
    case = ops.parse_case(new)
    assert case.id == new and case.p["dv"] == 32 and case.p["part"] == "block"
    with pytest.raises(Exception, match="blk > 0 is the block size"):
        ops.parse_case(base.format(extra="", part="part=block,"))
    with pytest.raises(Exception, match="dv must be <= d"):
        ops.parse_case(base.format(extra="dv=65,vk=1,", part=""))


def test_an_aliased_value_cache_is_one_buffer():
    case = ops.parse_case("attention.decode/torch/fp32/b=2,sq=1,kv=5,hq=4,hkv=1,d=72,dv=64,vk=1,lens=full,"
                          "causal=bottom_right,wl=-1,wr=-1,cap=0,sink=0/normal/seed=0")
    runner = Runner()
    runner.capture = {}
    rec = runner.evaluate(case)
    assert rec.verdict == "pass"
    inputs = runner.capture[case.id]["inputs"]
    assert "v_cache" not in inputs and inputs["k_cache"].shape[-1] == 72
    assert runner.capture[case.id]["golden"]["o"].shape == (2, 1, 4, 64)


def test_ci_covers_a_paged_write_from_mid_page_into_the_next_page():
    from kernel_parity.conformance import suites
    from kernel_parity.conformance.runner import Prepared

    spec = ops.get("kvcache.update")
    crossing = []
    for case in suites.cases("ci"):
        if case.op != spec.name or case.p["layout"] == "contiguous" or case.dtype != "fp32":
            continue
        page = {"paged16": 16, "paged64": 64}[case.p["layout"]]
        pos = Prepared(spec, case).inputs["pos"].astype(int)
        if ((pos % page != 0) & (pos % page + case.p["snew"] > page)).any():
            crossing.append(case.id)
    assert crossing, "no ci kvcache.update case writes from the middle of a page into the next page"


def test_triton_prefill_kernels_skip_head_dims_past_256():
    case = ops.parse_case(PREFILL.format(b="triton").replace("d=16,", "d=288,dv=256,"))
    assert "head dims <= 256" in Registry().get("triton").supports(case)


def test_decode_split_page_defaults_to_the_contiguous_cache_and_rejects_other_sizes(capsys):
    base = ("attention.decode_split/torch/fp32/b=2,sq=1,kv=5,hq=4,hkv=2,d=64,lens=full,splits=2,{page}"
            "causal=bottom_right,wl=-1,wr=-1,cap=0,sink=0/normal/seed=0")
    plain = base.format(page="")
    assert ops.parse_case(base.format(page="page=0,")).id == plain and "page" not in ops.parse_case(plain).p
    assert ops.parse_case(base.format(page="page=16,")).p["page"] == 16
    assert main(["repro", base.format(page="page=32,")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "page" in err[0] and "0, 16, 64" in err[0]
    chunked = ops.parse_case("attention.chunked_prefill/torch/fp32/b=1,sq=2,hist=3,hq=2,hkv=1,d=16,lens=full,"
                             "page=0,causal=bottom_right,wl=-1,wr=-1,cap=0,sink=0/normal/seed=0")
    assert chunked.p["page"] == 0 and ",page=0," in chunked.id  # decode_split's default is its own


def test_ci_covers_paged_splits_of_fixed_256_key_blocks_and_splits_that_start_inside_a_page():
    from kernel_parity.conformance import suites
    from kernel_parity.conformance.runner import Prepared
    from kernel_parity.refimpl.attention import split_bounds

    trt, inside = [], []
    for case in suites.cases("ci"):
        if case.op != "attention.decode_split" or "page" not in case.p or case.backend != "triton":
            continue
        page = case.p["page"]
        if case.p.get("blk") == 256:
            trt.append(page)
        x = Prepared(ops.get(case.op), case).inputs
        start, end = split_bounds(x["seqlens"], case.p["splits"], block=case.p.get("blk") or None,
                                  bounds=x.get("split_bounds"))
        # a split that starts inside a page and runs past that page's end: its keys span two pages
        if ((start % page != 0) & (end > (start // page + 1) * page)).any():
            inside.append(case.id)
    assert sorted(set(trt)) == [16, 64], "ci has no 256-key split blocks over pages of 16 and of 64"
    assert inside, "no ci decode_split case has a split starting inside a page and crossing the next page boundary"
