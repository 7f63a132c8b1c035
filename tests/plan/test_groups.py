"""Collective groups in every form XLA prints, and combined collectives, on hand-built HLO text.

Each expected group is worked out by hand in the comment beside it, from the form's definition
(qkvflow/plan/groups.py's docstring), not by running the parser's own arithmetic.
"""

import pytest

from qkvflow.plan import groups, roofline
from qkvflow.plan.hlo import collectives, parse


@pytest.mark.parametrize(
    "attrs, n, expected",
    [
        # explicit lists
        ("replica_groups={{0,1},{2,3}}, dimensions={0}", 4, [[0, 1], [2, 3]]),
        # none, or {}: every device of the program
        ("dimensions={0}", 4, [[0, 1, 2, 3]]),
        ("replica_groups={}, to_apply=%add", 4, [[0, 1, 2, 3]]),
        # iota [2,2]<=[4]: 0 1 2 3 read as two groups of two
        ("replica_groups=[2,2]<=[4], dimensions={0}", 4, [[0, 1], [2, 3]]),
        # iota transposed, [4,2]<=[2,4]T(1,0) on 8: rows 0 1 2 3 / 4 5 6 7, transposed: columns
        # (0,4) (1,5) (2,6) (3,7), read as four groups of two
        ("replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true", 8, [[0, 4], [1, 5], [2, 6], [3, 7]]),
        # mesh a=4 x b=2 (device 2a + b), grouped over a: b fixed, a varies
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}", 8, [[0, 2, 4, 6], [1, 3, 5, 7]]),
        # ... grouped over b: a fixed, b varies
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={0}", 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        # ... over both: one group of all
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", 8, [[0, 1, 2, 3, 4, 5, 6, 7]]),
        # names unquoted, as some XLA versions print them
        ("replica_groups=mesh[x=2,y=2] {y}, to_apply=%add", 4, [[0, 1], [2, 3]]),
        # a mesh a=2 x b=4 laid on devices in the order [4,2]T(1,0): 0 2 4 6 1 3 5 7, so a=0 holds
        # 0 2 4 6 and a=1 holds 1 3 5 7; grouped over a: (0,1) (2,3) (4,5) (6,7)
        ("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}, x=1", 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        # ... grouped over b
        ("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}, x=1", 8, [[0, 2, 4, 6], [1, 3, 5, 7]]),
        # the same order given as a list
        ("replica_groups=mesh['a'=2,'b'=4], device_ids=(0,2,4,6,1,3,5,7) {'a'}", 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        # a sub-axis: a=8 split 2 x 2 x 2 (device 4x + 2y + z), 'a':(2)2 is y
        ("replica_groups=mesh['a'=8] {'a':(2)2}, dimensions={0}", 8, [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ],
)
def test_every_replica_groups_form_is_read(attrs, n, expected):
    assert groups.device_groups("all-reduce", attrs, n) == expected


def test_a_collective_permute_groups_its_pairs():
    attrs = "channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
    assert groups.device_groups("collective-permute-start", attrs, 4) == [[0, 1], [1, 2], [2, 3], [3, 0]]


def test_an_unknown_form_is_refused_rather_than_read_as_every_device():
    with pytest.raises(ValueError, match="unread form"):
        groups.device_groups("all-gather", "replica_groups=ring(8), dimensions={0}", 8)


def test_groups_cross_nodes_only_when_a_group_holds_two_nodes():
    nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    assert not groups.crosses_nodes([[0, 1, 2, 3], [4, 5, 6, 7]], nodes)
    assert groups.crosses_nodes([[0, 4], [1, 5]], nodes)
    assert not groups.crosses_nodes([[0, 4]], None)


# A combined all-gather of 12 arrays (XLA's comments before the 6th and the 11th operand, the types
# not printed inline: looked up by name), a combined reduce-scatter of 7, both on a two-axis mesh
# data=4 x model=2, and an all-reduce over the model axis.
MESH = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: bf16[12,32]) -> bf16[32] {
  %p = bf16[12,32]{1,0} parameter(0)
  %a0 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a1 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a2 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a3 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a4 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a5 = bf16[64,2]{1,0} fusion(%p), kind=kLoop, calls=%add
  %a6 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a7 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a8 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a9 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %a10 = f32[16,8]{1,0} fusion(%p), kind=kLoop, calls=%add
  %a11 = bf16[32]{0} fusion(%p), kind=kLoop, calls=%add
  %ag = ((bf16[32]{0}, bf16[32]{0}, bf16[32]{0}, bf16[32]{0}, bf16[32]{0}, /*index=5*/bf16[64,2]{1,0}, bf16[32]{0}, bf16[32]{0}, bf16[32]{0}, bf16[32]{0}, /*index=10*/f32[16,8]{1,0}, bf16[32]{0}), (bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, /*index=5*/bf16[256,2]{1,0}, bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, /*index=10*/f32[64,8]{1,0}, bf16[128]{0})) all-gather-start(%a0, %a1, %a2, %a3, %a4, /*index=5*/%a5, %a6, %a7, %a8, %a9, /*index=10*/%a10, %a11), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %agd = (bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, /*index=5*/bf16[256,2]{1,0}, bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, bf16[128]{0}, /*index=10*/f32[64,8]{1,0}, bf16[128]{0}) all-gather-done(%ag)
  %rs = ((bf16[32]{0}, bf16[32]{0}, bf16[32]{0}, bf16[32]{0}, bf16[32]{0}, /*index=5*/bf16[64,2]{1,0}, f32[16,8]{1,0}), (bf16[8]{0}, bf16[8]{0}, bf16[8]{0}, bf16[8]{0}, bf16[8]{0}, /*index=5*/bf16[16,2]{1,0}, f32[4,8]{1,0})) reduce-scatter-start(%a0, %a1, %a2, %a3, %a4, /*index=5*/%a5, %a10), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true, to_apply=%add
  %rsd = (bf16[8]{0}, bf16[8]{0}, bf16[8]{0}, bf16[8]{0}, bf16[8]{0}, /*index=5*/bf16[16,2]{1,0}, f32[4,8]{1,0}) reduce-scatter-done(%rs)
  %ar = bf16[32]{0} all-reduce(%a11), channel_id=3, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, use_global_device_ids=true, to_apply=%add
  ROOT %r = bf16[32]{0} copy(%ar)
}
"""


def test_a_combined_collective_counts_every_operand_and_its_groups_on_two_axes():
    c = collectives(MESH)
    # all-gather: ten bf16[32] (64 bytes each), one bf16[64,2] (256), one f32[16,8] (512): 1,408 bytes
    # per device, gathered over the data axis (groups of 4): 5,632
    operands = 10 * 32 * 2 + 64 * 2 * 2 + 16 * 8 * 4
    assert operands == 1408
    assert (c["all-gather"]["count"], c["all-gather"]["bytes"]) == (1, 4 * 1408)
    assert c["all-gather"]["group_sizes"] == [4]
    # reduce-scatter: five bf16[32], one bf16[64,2], one f32[16,8]: 320 + 256 + 512 bytes reduced,
    # groups [2,4]<=[4,2]T(1,0) = (0,2,4,6) (1,3,5,7): four devices each
    assert (c["reduce-scatter"]["bytes"], c["reduce-scatter"]["group_sizes"]) == (5 * 64 + 256 + 512, [4])
    # the all-reduce over the model axis: pairs
    assert (c["all-reduce"]["bytes"], c["all-reduce"]["group_sizes"]) == (64, [2])


def test_a_group_inside_a_node_runs_at_the_link_rate_and_one_across_at_the_network_rate():
    # 4 devices to a node: the data axis (devices 0 2 4 6) spans both nodes, the model axis (0 1) does not
    link, network = 100.0, 1.0
    e = roofline.estimate(
        MESH, peak_flops=1e30, hbm_bytes_per_s=1e30, link_bytes_per_s=link, network_bytes_per_s=network,
        devices_per_node=4,
    )  # fmt: skip
    gather = 3 / 4 * 4 * 1408  # ring all-gather over 4: (n-1)/n of the gathered array
    scatter = 3 / 4 * (5 * 64 + 256 + 512)
    reduce = 2 * 1 / 2 * 64  # ring all-reduce over 2: 2 (n-1)/n of the array
    assert e["collective_bytes_sent"] == pytest.approx(gather + scatter + reduce, rel=1e-12)
    assert e["network_bytes_sent"] == pytest.approx(gather + scatter, rel=1e-12)
    assert e["collectives_s"] == pytest.approx((gather + scatter) / network + reduce / link, rel=1e-12)
    # all eight devices in one node: everything over the link
    e = roofline.estimate(
        MESH, peak_flops=1e30, hbm_bytes_per_s=1e30, link_bytes_per_s=link, network_bytes_per_s=network,
        devices_per_node=8,
    )  # fmt: skip
    assert e["network_bytes_sent"] == 0
    assert e["collectives_s"] == pytest.approx((gather + scatter + reduce) / link, rel=1e-12)
    # the nodes a plan reads from its mesh win over devices_per_node
    c = collectives(MESH, nodes=[0, 1, 0, 1, 0, 1, 0, 1])
    assert c["all-gather"]["network_bytes"] == 0 and c["all-reduce"]["network_bytes"] == 64


def test_an_all_gather_is_charged_its_own_ring_traffic_not_an_all_reduces():
    text = MESH.replace("all-reduce(%a11)", "all-gather(%a11)").replace(
        "{'axis_1'}, use", "{'axis_1'}, dimensions={0}, use"
    )
    text = text.replace("%ar = bf16[32]{0}", "%ar = bf16[64]{0}").replace(
        "bf16[32]{0} copy(%ar)", "bf16[64]{0} copy(%ar)"
    )
    c = collectives(text)
    assert c["all-gather"]["count"] == 2 and "all-reduce" not in c
    assert c["all-gather"]["bytes"] == 4 * 1408 + 2 * 64  # the gathered pair: operand x 2
    e = roofline.estimate(text, peak_flops=1e30, hbm_bytes_per_s=1e30, link_bytes_per_s=1.0)
    gather = 3 / 4 * 4 * 1408 + 1 / 2 * 2 * 64  # (n-1)/n of each gathered array
    assert e["collective_bytes_sent"] == pytest.approx(gather + 3 / 4 * (5 * 64 + 256 + 512), rel=1e-12)


def test_every_operand_of_a_custom_call_is_read_past_xlas_index_comments():
    # cuDNN's attention backward takes more than five operands; its bytes are all of them plus its result
    text = """HloModule m

ENTRY %main (q: bf16[2,8,4,16]) -> bf16[2,8,4,16] {
  %q = bf16[2,8,4,16]{3,2,1,0} parameter(0)
  %k = bf16[2,8,4,16]{3,2,1,0} copy(%q)
  %v = bf16[2,8,4,16]{3,2,1,0} copy(%q)
  %s = f32[2,4,8]{2,1,0} parameter(1)
  %o = bf16[2,8,4,16]{3,2,1,0} copy(%q)
  %d = bf16[2,8,4,16]{3,2,1,0} copy(%q)
  %b = (bf16[2,8,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v, %s, %o, /*index=5*/%d), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  ROOT %r = bf16[2,8,4,16]{3,2,1,0} get-tuple-element(%b), index=0
}
"""
    module = parse(text)
    (call,) = [i for i in module.computations["main"] if i.opcode == "custom-call"]
    array = 2 * 8 * 4 * 16 * 2
    assert len(module.operand_types(call)) == 6
    assert roofline.kernel_bytes(module, call) == 5 * array + 2 * 4 * 8 * 4 + array


def test_a_tpu_multi_slice_transfer_counts_as_its_collective_across_nodes():
    # XLA:TPU compiles one slice's program; a reduction across slices is a send to the DCN runtime
    text = """HloModule m, num_partitions=8

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}

ENTRY %main (g: bf16[2,8,128]) -> bf16[2,8,128] {
  %g = bf16[2,8,128]{2,1,0} parameter(0)
  %t = token[] after-all()
  %s = (bf16[2,8,128]{2,1,0}, u32[], token[]) send(%g, %t), channel_id=16, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",_xla_megascale_transfer_type="ALL_REDUCE"}
  %ar = bf16[2,8,128]{2,1,0} all-reduce(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %c = bf16[2,8,128]{2,1,0} copy(%ar)
}
"""
    c = collectives(text, slices=2)
    array = 2 * 8 * 128 * 2
    # the slice's own all-reduce over its 8 chips, and the one across the 2 slices
    assert c["all-reduce"]["count"] == 2 and c["all-reduce"]["bytes"] == 2 * array
    assert c["all-reduce"]["group_sizes"] == [2, 8]
    assert c["all-reduce"]["network_count"] == 1 and c["all-reduce"]["network_bytes"] == array
