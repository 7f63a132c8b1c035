"""Kernel and collective counting on a hand-written HLO module, against counts made by hand."""

from qkvflow.plan.hlo import collectives, count_kernels, nbytes, parse

# entry: 2 fusions, a copy, a cuBLAS GEMM, an all-gather (async pair), a reduce-scatter wrapped in
# async-start/done, an all-reduce with explicit groups, a while (5 trips, known) and a while (trip
# count unknown), a conditional (branches of 1 and 3 kernels); parameters/tuples/gte/bitcasts are free.
HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%fused_add (p0: f32[8,16]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  ROOT %add = f32[8,16]{1,0} add(%p0, %p0)
}

%fused_dot (p0.1: bf16[4,32], p1.1: bf16[32,64]) -> bf16[4,64] {
  %p0.1 = bf16[4,32]{1,0} parameter(0)
  %p1.1 = bf16[32,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4,64]{1,0} dot(%p0.1, %p1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (b: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %b = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%b), index=1
  %f1 = f32[8,16]{1,0} fusion(%x), kind=kLoop, calls=%fused_add
  %f2 = f32[8,16]{1,0} fusion(%f1), kind=kLoop, calls=%fused_add
  %g = (f32[8,16]{1,0}, s8[1024]{0}) custom-call(%f2, %f2), custom_call_target="__cublas$lt$matmul"
  %gx = f32[8,16]{1,0} get-tuple-element(%g), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %gx)
}

%cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] fusion(%c), kind=kLoop, calls=%fused_add
}

%inner_body (q: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  %qi = s32[] get-tuple-element(%q), index=0
  %qx = f32[8,16]{1,0} get-tuple-element(%q), index=1
  %ar = f32[8,16]{1,0} all-reduce(%qx), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%fused_add
  ROOT %qt = (s32[], f32[8,16]{1,0}) tuple(%qi, %ar)
}

%branch_small (s: f32[8,16]) -> f32[8,16] {
  %s = f32[8,16]{1,0} parameter(0)
  ROOT %s1 = f32[8,16]{1,0} fusion(%s), kind=kLoop, calls=%fused_add
}

%branch_big (u: f32[8,16]) -> f32[8,16] {
  %u = f32[8,16]{1,0} parameter(0)
  %u1 = f32[8,16]{1,0} fusion(%u), kind=kLoop, calls=%fused_add
  %u2 = f32[8,16]{1,0} fusion(%u1), kind=kLoop, calls=%fused_add
  ROOT %u3 = f32[8,16]{1,0} copy(%u2)
}

%rs_comp (r: f32[64,16]) -> f32[8,16] {
  %r = f32[64,16]{1,0} parameter(0)
  ROOT %rs = f32[8,16]{1,0} reduce-scatter(%r), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%fused_add
}

ENTRY %main (a: f32[8,16], w: bf16[4,32], v: bf16[32,64], big: f32[64,16], k: pred[]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %w = bf16[4,32]{1,0} parameter(1)
  %v = bf16[32,64]{1,0} parameter(2)
  %big = f32[64,16]{1,0} parameter(3)
  %k = pred[] parameter(4)
  %e1 = f32[8,16]{1,0} fusion(%a), kind=kLoop, calls=%fused_add
  %e2 = bf16[4,64]{1,0} fusion(%w, %v), kind=kCustom, calls=%fused_dot
  %cp = f32[8,16]{1,0} copy(%e1)
  %bc = f32[128]{0} bitcast(%cp)
  %ags = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%cp), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[64,16]{1,0} all-gather-done(%ags)
  %rss = ((f32[64,16]{1,0}), f32[8,16]{1,0}) async-start(%big), calls=%rs_comp
  %rsd = f32[8,16]{1,0} async-done(%rss)
  %s0 = s32[] constant(0)
  %t0 = (s32[], f32[8,16]{1,0}) tuple(%s0, %cp)
  %w1 = (s32[], f32[8,16]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %w2 = (s32[], f32[8,16]{1,0}) while(%t0), condition=%cond, body=%inner_body
  %x2 = f32[8,16]{1,0} get-tuple-element(%w2), index=1
  ROOT %cd = f32[8,16]{1,0} conditional(%k, %x2, %x2), branch_computations={%branch_small, %branch_big}
}
"""


def test_nbytes_reads_arrays_and_tuples():
    assert nbytes("f32[8,16]{1,0}") == 8 * 16 * 4
    assert nbytes("(bf16[4,64]{1,0}, s8[1024]{0})") == 4 * 64 * 2 + 1024
    assert nbytes("f32[]") == 4 and nbytes("pred[3]") == 3


def test_parse_finds_the_entry_and_every_computation():
    module = parse(HLO)
    assert module.entry == "main" and module.num_partitions == 8
    assert len(module.computations) == 9
    # operand types are looked up by name when the printer leaves them out
    (dot,) = [i for i in module.computations["fused_dot"] if i.opcode == "dot"]
    assert module.operand_types(dot) == ["bf16[4,32]{1,0}", "bf16[32,64]{1,0}"]


def test_kernels_are_counted_as_the_gpu_runtime_runs_them():
    k = count_kernels(HLO)
    # entry: e1, e2, cp, all-gather-start, reduce-scatter (inside async) = 5
    # while w1 (5 trips, known): body 3 kernels x 5 = 15, its condition never runs
    # while w2 (unknown, taken as 1): inner all-reduce x 1 + condition 1 x 2 = 3
    # conditional: the costlier branch, 3 kernels
    assert k["launches"] == 5 + 15 + 3 + 3
    assert k["static"] == 5 + 3 + 2 + 3
    assert k["fusions"] == 2 + 2 + 1 + 2  # entry, w1's body, w2's condition, branch_big's 2
    assert k["custom_calls"] == {"__cublas$lt$matmul": 5}
    assert k["unknown_trip_counts"] == 1
    # w2's condition twice (the predicate copied to the host each time), the conditional's index once
    assert k["host_syncs"] == 2 + 1
    assert k["once_per_step"] == 5 + 3
    loops = sorted((loop["trip_count"], loop["known"], loop["launches_per_iteration"]) for loop in k["loops"])
    assert loops == [(1, False, 1), (5, True, 3)]  # w2's body: the all-reduce; w1's: 3 kernels


def test_a_loop_without_a_trip_count_takes_the_one_given():
    k = count_kernels(HLO, unknown_trip_count=4)
    assert k["launches"] == 5 + 15 + (4 + 5) + 3  # w2: all-reduce x 4, condition x 5
    assert k["by_opcode"]["all-reduce"] == 4
    assert k["host_syncs"] == 5 + 1


def test_collectives_count_their_arrays_and_groups():
    c = collectives(HLO, unknown_trip_count=3)
    ag = 8 * 16 * 4 * 8  # the gathered array: the operand x 8 devices
    one_node = {"network_count": 0, "network_bytes": 0}
    assert c["all-gather"] == {"count": 1, "bytes": ag, "group_size": 8, "group_sizes": [8], **one_node}
    assert c["reduce-scatter"] == {"count": 1, "bytes": 64 * 16 * 4, "group_size": 8, "group_sizes": [8], **one_node}
    assert c["all-reduce"] == {"count": 3, "bytes": 3 * 8 * 16 * 4, "group_size": 4, "group_sizes": [4], **one_node}


def test_the_gpu_start_and_done_pairs_are_one_collective_each():
    text = """HloModule m, num_partitions=8

ENTRY %main (g: bf16[64,32], h: bf16[8]) -> bf16[8,32] {
  %g = bf16[64,32]{1,0} parameter(0)
  %h = bf16[8]{0} parameter(1)
  %rs = ((bf16[64,32]{1,0}, bf16[8]{0}), (bf16[8,32]{1,0}, bf16[1]{0})) reduce-scatter-start(%g, %h), replica_groups=[1,8]<=[8], dimensions={0}
  %rd = (bf16[8,32]{1,0}, bf16[1]{0}) reduce-scatter-done(%rs)
  ROOT %r = bf16[8,32]{1,0} get-tuple-element(%rd), index=0
}
"""
    (rs,) = collectives(text).values()
    assert (rs["count"], rs["bytes"], rs["group_size"]) == (1, (64 * 32 + 8) * 2, 8)
    assert count_kernels(text)["launches"] == 1


def test_op_name_reads_the_jax_name_stack_from_the_metadata():
    text = """HloModule m

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %n = f32[8]{0} negate(%a), metadata={op_name="jit(step)/transpose(jvp(lm_head))/neg" source_file="x.py" source_line=3}
  %q = f32[8]{0} add(%n, %n), metadata={op_name="jit(step)/say \\"hi\\"/add"}
  ROOT %c = f32[8]{0} copy(%q)
}
"""
    n, q, c = parse(text).computations["main"][1:]
    assert n.op_name() == "jit(step)/transpose(jvp(lm_head))/neg"
    assert q.op_name() == 'jit(step)/say \\"hi\\"/add' and c.op_name() == ""


# Control flow as XLA's GPU runtime runs it (qkvflow/plan/hlo.py's docstring): an outer loop of 3
# known trips whose body holds an inner loop of 4 known trips, a `call` and an async reduce-scatter;
# an unknown-trip loop (taken as 5) whose body holds a conditional and a known loop of 2.
NESTED = """HloModule m, num_partitions=2

%k1 (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%x)
}

%inner_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %f = f32[8]{0} fusion(%v), kind=kLoop, calls=%k1
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %f)
}

%inner_cond (t.1: (s32[], f32[8])) -> pred[] {
  %t.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] fusion(%t.1), kind=kLoop, calls=%k1
}

%called (y: f32[8]) -> f32[8] {
  %y = f32[8]{0} parameter(0)
  %y1 = f32[8]{0} fusion(%y), kind=kLoop, calls=%k1
  ROOT %y2 = f32[8]{0} fusion(%y1), kind=kLoop, calls=%k1
}

%scatter (z: f32[8]) -> f32[4] {
  %z = f32[8]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%z), replica_groups={{0,1}}, dimensions={0}, to_apply=%k1
}

%outer_body (o: (s32[], f32[8])) -> (s32[], f32[8]) {
  %o = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%o), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
  %wv = f32[8]{0} get-tuple-element(%w), index=1
  %cl = f32[8]{0} call(%wv), to_apply=%called
  %as = ((f32[8]{0}), f32[4]{0}) async-start(%cl), calls=%scatter
  %ad = f32[4]{0} async-done(%as)
  %oi = s32[] get-tuple-element(%o), index=0
  ROOT %or = (s32[], f32[8]{0}) tuple(%oi, %cl)
}

%outer_cond (o.1: (s32[], f32[8])) -> pred[] {
  %o.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %oc = pred[] fusion(%o.1), kind=kLoop, calls=%k1
}

%yes (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %a1 = f32[8]{0} fusion(%a), kind=kLoop, calls=%k1
}

%no (b: f32[8]) -> f32[8] {
  %b = f32[8]{0} parameter(0)
  ROOT %b1 = f32[8]{0} copy(%b)
}

%solve_body (s: (s32[], f32[8])) -> (s32[], f32[8]) {
  %s = (s32[], f32[8]{0}) parameter(0)
  %sv = f32[8]{0} get-tuple-element(%s), index=1
  %p = pred[] fusion(%sv), kind=kLoop, calls=%k1
  %cd = f32[8]{0} conditional(%p, %sv, %sv), true_computation=%yes, false_computation=%no
  %si = s32[] get-tuple-element(%s), index=0
  %t2 = (s32[], f32[8]{0}) tuple(%si, %cd)
  %w2 = (s32[], f32[8]{0}) while(%t2), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %sr = (s32[], f32[8]{0}) tuple(%si, %cd)
}

%solve_cond (s.1: (s32[], f32[8])) -> pred[] {
  %s.1 = (s32[], f32[8]{0}) parameter(0)
  %s2 = f32[8]{0} get-tuple-element(%s.1), index=1
  %s3 = f32[8]{0} fusion(%s2), kind=kLoop, calls=%k1
  ROOT %sc = pred[] fusion(%s3), kind=kLoop, calls=%k1
}

ENTRY %main (e: (s32[], f32[8])) -> (s32[], f32[8]) {
  %e = (s32[], f32[8]{0}) parameter(0)
  %outer = (s32[], f32[8]{0}) while(%e), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %solve = (s32[], f32[8]{0}) while(%outer), condition=%solve_cond, body=%solve_body
}
"""


def test_nested_loops_calls_async_ops_and_conditionals_keep_their_enclosing_weight():
    k = count_kernels(NESTED, unknown_trip_count=5)
    # outer (3 known trips), per trip: the inner loop's body 4 x 1 fusion, the call's 2 fusions, the
    # async reduce-scatter 1: 3 x (4 + 2 + 1) = 21; no condition runs (both counts are known)
    outer = 3 * (4 * 1 + 2 + 1)
    # solve (unknown, taken as 5): condition 2 fusions x 6; body per trip: the predicate fusion, the
    # conditional's costlier branch (1 fusion; the other is a copy, also 1: either), the known loop 2 x 1
    solve = 2 * 6 + 5 * (1 + 1 + 2 * 1)
    assert k["launches"] == outer + solve
    assert k["by_opcode"]["reduce-scatter"] == 3  # inside async-start, inside the outer loop
    assert k["by_opcode"]["fusion"] == outer - 3 + solve
    # host synchronisations: the solve's condition 6 times, its conditional 5 times
    assert k["host_syncs"] == 6 + 5 and k["host_syncs_by"] == {"while": 6, "conditional": 5}
    assert k["once_per_step"] == 0  # every launch is in a loop


def test_collectives_inside_loops_and_async_ops_are_weighted_by_their_loops():
    c = collectives(NESTED, unknown_trip_count=5)
    assert c["reduce-scatter"]["count"] == 3 and c["reduce-scatter"]["bytes"] == 3 * 8 * 4
    assert c["reduce-scatter"]["group_sizes"] == [2]
