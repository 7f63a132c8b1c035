"""The roofline estimate of a hand-written HLO module against the same sums done by hand."""

import pytest

from qkvflow.plan import roofline
from qkvflow.plan.hlo import parse

HLO = """HloModule jit_step, num_partitions=4

%mm (a: bf16[128,256], b: bf16[256,512]) -> bf16[128,512] {
  %a = bf16[128,256]{1,0} parameter(0)
  %b = bf16[256,512]{1,0} parameter(1)
  ROOT %d = bf16[128,512]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%ew (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  ROOT %m = f32[1024,1024]{1,0} multiply(%x, %x)
}

%dus (buf: f32[16,1024], upd: f32[1,1024], i: s32[]) -> f32[16,1024] {
  %buf = f32[16,1024]{1,0} parameter(0)
  %upd = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[16,1024]{1,0} dynamic-update-slice(%buf, %upd, %i, %z)
}

%ds (buf.1: f32[16,1024], j: s32[]) -> f32[1,1024] {
  %buf.1 = f32[16,1024]{1,0} parameter(0)
  %j = s32[] parameter(1)
  %z.1 = s32[] constant(0)
  ROOT %s = f32[1,1024]{1,0} dynamic-slice(%buf.1, %j, %z.1), dynamic_slice_sizes={1,1024}
}

%body (t: (s32[], bf16[128,256], bf16[256,512])) -> (s32[], bf16[128,256], bf16[256,512]) {
  %t = (s32[], bf16[128,256]{1,0}, bf16[256,512]{1,0}) parameter(0)
  %a.1 = bf16[128,256]{1,0} get-tuple-element(%t), index=1
  %b.1 = bf16[256,512]{1,0} get-tuple-element(%t), index=2
  %f = bf16[128,512]{1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%mm
  ROOT %t2 = (s32[], bf16[128,256]{1,0}, bf16[256,512]{1,0}) tuple(%i.0, %a.1, %b.1)
}

%cond (c: (s32[], bf16[128,256], bf16[256,512])) -> pred[] {
  %c = (s32[], bf16[128,256]{1,0}, bf16[256,512]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[1024,1024], buf: f32[16,1024], upd: f32[1,1024], i: s32[], v: f32[1024], t: (s32[], bf16[128,256], bf16[256,512])) -> f32[1024,1024] {
  %x.0 = f32[1024,1024]{1,0} parameter(0)
  %buf.0 = f32[16,1024]{1,0} parameter(1)
  %upd.0 = f32[1,1024]{1,0} parameter(2)
  %i.0 = s32[] parameter(3)
  %v.0 = f32[1024]{0} parameter(4)
  %t.0 = (s32[], bf16[128,256]{1,0}, bf16[256,512]{1,0}) parameter(5)
  %w = (s32[], bf16[128,256]{1,0}, bf16[256,512]{1,0}) while(%t.0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
  %e = f32[1024,1024]{1,0} fusion(%x.0), kind=kLoop, calls=%ew
  %up = f32[16,1024]{1,0} fusion(%buf.0, %upd.0, %i.0), kind=kLoop, calls=%dus
  %sl = f32[1,1024]{1,0} fusion(%up, %i.0), kind=kLoop, calls=%ds
  %ar = f32[1024]{0} all-reduce(%v.0), replica_groups={{0,1,2,3}}, to_apply=%ew
  ROOT %out = f32[1024,1024]{1,0} copy(%e)
}
"""

P, W, L = 1e12, 1e11, 1e9


def test_the_step_is_the_sum_of_each_kernels_roofline_and_the_ring_traffic():
    e = roofline.estimate(HLO, peak_flops=P, hbm_bytes_per_s=W, link_bytes_per_s=L, model_flops=2e8)
    dot_flops = 2 * 128 * 512 * 256
    dot_bytes = (128 * 256 + 256 * 512 + 128 * 512) * 2
    ew_bytes = 2 * 1024 * 1024 * 4  # read x, write the product
    dus_bytes = 1024 * 4 + 4 + 1024 * 4  # read the update and the index, write the update in place
    ds_bytes = 4 + 1024 * 4 + 1024 * 4  # the index, the slice read, the slice written
    copy_bytes = 2 * 1024 * 1024 * 4
    ring = 2 * 3 / 4 * 1024 * 4  # all-reduce over 4 devices
    assert e["hlo_flops"] == 10 * dot_flops
    assert e["hbm_bytes"] == 10 * dot_bytes + ew_bytes + dus_bytes + ds_bytes + copy_bytes + 2 * 1024 * 4
    assert e["collective_bytes_sent"] == ring
    kernels = 10 * max(dot_flops / P, dot_bytes / W) + (ew_bytes + dus_bytes + ds_bytes + copy_bytes) / W
    assert e["kernels_s"] == pytest.approx(kernels, rel=1e-12)
    assert e["collectives_s"] == pytest.approx(ring / L, rel=1e-12)
    assert e["step_s"] == pytest.approx(kernels + ring / L, rel=1e-12)
    assert e["mfu"] == pytest.approx(2e8 / ((kernels + ring / L) * P), rel=1e-12)


def test_without_a_peak_there_is_no_time():
    e = roofline.estimate(HLO, peak_flops=None, hbm_bytes_per_s=None, link_bytes_per_s=None)
    assert e["step_s"] is None and e["mfu"] is None and e["hlo_flops"] == 10 * 2 * 128 * 512 * 256


@pytest.mark.parametrize("target, factor", [("__cudnn$fmhaSoftmax", 1.0), ("__cudnn$fmhaSoftmaxBackward", 2.5)])
@pytest.mark.parametrize("mask, halved", [("NO_MASK", 1.0), ("CAUSAL", 0.5)])
def test_fused_attention_flops(target, factor, mask, halved):
    text = f"""HloModule m

ENTRY %main (q: bf16[2,128,4,64], k: bf16[2,256,4,64], v: bf16[2,256,4,64]) -> bf16[2,128,4,64] {{
  %q = bf16[2,128,4,64]{{3,2,1,0}} parameter(0)
  %k = bf16[2,256,4,64]{{3,2,1,0}} parameter(1)
  %v = bf16[2,256,4,64]{{3,2,1,0}} parameter(2)
  ROOT %o = (bf16[2,128,4,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="{target}", backend_config={{"cudnn_fmha_backend_config":{{"mask_type":"{mask}"}}}}
}}
"""
    e = roofline.estimate(text, peak_flops=None, hbm_bytes_per_s=None, link_bytes_per_s=None)
    # QK^T and PV: 2 matmuls of 2 x B x H x Sq x Skv x D FLOPs each
    assert e["hlo_flops"] == 2 * (2 * 2 * 4 * 128 * 256 * 64) * factor * halved


def test_a_cublas_gemm_counts_its_contracted_dimension():
    text = """HloModule m

ENTRY %main (a: bf16[64,96], b: bf16[96,32]) -> bf16[64,32] {
  %a = bf16[64,96]{1,0} parameter(0)
  %b = bf16[96,32]{1,0} parameter(1)
  %g = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %r = bf16[64,32]{1,0} get-tuple-element(%g), index=0
}
"""
    assert parse(text).entry == "main"
    e = roofline.estimate(text, peak_flops=None, hbm_bytes_per_s=None, link_bytes_per_s=None)
    assert e["hlo_flops"] == 2 * 64 * 32 * 96


def test_each_kernels_share_sums_to_the_estimate():
    rows = list(roofline.kernels(HLO, peak_flops=P, hbm_bytes_per_s=W))
    assert [(k["instr"].name, k["launches"]) for k in rows] == [("f", 10), ("e", 1), ("up", 1), ("sl", 1), ("ar", 1), ("out", 1)]  # fmt: skip
    dot, ew, up, *_, ar, out = rows
    assert dot["flops"] == 2 * 128 * 512 * 256 and dot["bytes"] == (128 * 256 + 256 * 512 + 128 * 512) * 2
    assert dot["seconds"] == max(dot["flops"] / P, dot["bytes"] / W) and ew["flops"] == 0
    assert up["bytes"] == 1024 * 4 + 4 + 1024 * 4  # the in-place update, as the estimate counts it
    assert ar["collective"] == "all-reduce" and ar["seconds"] is None  # the link's time, not a kernel's
    assert out["seconds"] == out["memory_s"] == 2 * 1024 * 1024 * 4 / W
    e = roofline.estimate(HLO, peak_flops=P, hbm_bytes_per_s=W, link_bytes_per_s=L)
    assert sum(k["launches"] * k["seconds"] for k in rows if k["seconds"]) == pytest.approx(e["kernels_s"], rel=1e-12)
    assert sum(k["launches"] * k["bytes"] for k in rows) == e["hbm_bytes"]
    assert all(k["seconds"] is None for k in roofline.kernels(HLO))  # no rates, no times


def test_a_product_of_two_f32_operands_runs_at_the_f32_peak():
    # one fusion with a bf16 product and an f32 one (a bf16 step's loss gradient), a cuBLAS GEMM on f32
    text = """HloModule m

%mixed (a: bf16[64,32], b: bf16[32,16], c: f32[64,32], d: f32[32,16]) -> (bf16[64,16], f32[64,16]) {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %c = f32[64,32]{1,0} parameter(2)
  %d = f32[32,16]{1,0} parameter(3)
  %lo = bf16[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %hi = f32[64,16]{1,0} dot(%c, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (bf16[64,16]{1,0}, f32[64,16]{1,0}) tuple(%lo, %hi)
}

ENTRY %main (a: bf16[64,32], b: bf16[32,16], c: f32[64,32], d: f32[32,16]) -> f32[64,16] {
  %a.0 = bf16[64,32]{1,0} parameter(0)
  %b.0 = bf16[32,16]{1,0} parameter(1)
  %c.0 = f32[64,32]{1,0} parameter(2)
  %d.0 = f32[32,16]{1,0} parameter(3)
  %f = (bf16[64,16]{1,0}, f32[64,16]{1,0}) fusion(%a.0, %b.0, %c.0, %d.0), kind=kCustom, calls=%mixed
  %g = (f32[64,16]{1,0}, s8[1024]{0}) custom-call(%c.0, %d.0), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %r = f32[64,16]{1,0} get-tuple-element(%g), index=0
}
"""
    one = 2 * 64 * 16 * 32
    fused, gemm = roofline.kernels(text, peak_flops=4.0, hbm_bytes_per_s=1e30, f32_peak_flops=1.0)
    assert (fused["flops"], fused["f32_flops"]) == (2 * one, one) and (gemm["flops"], gemm["f32_flops"]) == (one, one)
    assert fused["compute_s"] == one / 4.0 + one / 1.0 and gemm["seconds"] == one / 1.0
    e = roofline.estimate(text, peak_flops=4.0, hbm_bytes_per_s=1e30, link_bytes_per_s=None, f32_peak_flops=1.0)
    assert e["f32_flops"] == 2 * one and e["compute_s"] == one / 4.0 + 2 * one / 1.0
    # without an f32 peak everything runs at the compute dtype's, as before
    e = roofline.estimate(text, peak_flops=4.0, hbm_bytes_per_s=1e30, link_bytes_per_s=None)
    assert e["compute_s"] == 3 * one / 4.0


def test_a_bf16_by_f32_product_runs_at_the_compute_dtypes_peak():
    # one operand bf16, the other f32: not a product of two f32 operands, so not at the f32 rate
    text = """HloModule m

ENTRY %main (a: bf16[64,32], b: f32[32,16]) -> f32[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = f32[32,16]{1,0} parameter(1)
  ROOT %d = f32[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    one = 2 * 64 * 16 * 32
    (k,) = roofline.kernels(text, peak_flops=4.0, hbm_bytes_per_s=1e30, f32_peak_flops=1.0)
    assert (k["flops"], k["f32_flops"]) == (one, 0) and k["compute_s"] == one / 4.0
