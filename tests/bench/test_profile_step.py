"""benchmarks/profile_step.py places each kernel by the op_name XLA kept for it: part of the step and pass.

The op_names below are copied from the compiled training steps of `bench speed` (DiffEqFormer with
diffrax's loop, GPT-2 with Levanter's remat'd layer scan)."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "profile_step", Path(__file__).parents[2] / "benchmarks" / "profile_step.py"
)
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)

ODE_FWD = "jit(step)/jvp(jit(diffeqsolve))/outer-loop/checkpointed-fwd/while/body"
ODE_BWD = "jit(step)/transpose(jvp(jit(diffeqsolve)))/outer-loop/checkpointed-bwd/while/body"
CASES = [
    # forward solve: diffrax's checkpointed-fwd loop is the forward pass, not a recomputation
    (
        "ynn_fusion.1",
        "f32[4096,512]{1,0}",
        f"{ODE_FWD}/contract embed -> batch, position, mlp/dot_general",
        ("MLP products", "forward"),
    ),
    # backward loop: the recomputed forward, then the transposed products
    (
        "ynn_fusion.41",
        "f32[4096,512]{1,0}",
        f"{ODE_BWD}/jvp(contract embed -> batch, position, mlp)/dot_general",
        ("MLP products", "recompute"),
    ),
    (
        "ynn_fusion.40",
        "f32[4096,128]{1,0}",
        f"{ODE_BWD}/cond/branch_1_fun/transpose(jvp(contract embed -> batch, position, mlp))/dot_general",
        ("MLP products", "backward"),
    ),
    (
        "ynn_fusion.12",
        "f32[128,128]{1,0}",
        f"{ODE_BWD}/transpose(jvp(contract embed -> heads, head_size))/dot_general",
        ("other products (QKV/O, unembedding)", "backward"),
    ),
    (
        "ynn_fusion.22",
        "f32[64,4,64,64]{3,2,1,0}",
        "jit(step)/transpose(jvp(Gpt2Transformer))/scan(layers)/while/body/rematted_computation/"
        "dot_product_attention/reduce_sum",
        ("attention core (QK^T, softmax, AV)", "recompute"),
    ),
    (
        "dot.73",
        "f32[4,64]{1,0}",
        "jit(step)/transpose(jvp(weight_generation))/transpose",
        ("weight generation W(t_k)", "backward"),
    ),
    (
        "ynn_fusion.133",
        "f32[4,65536]{1,0}",
        "jit(step)/jvp(weight_generation)/dot_general",
        ("weight generation W(t_k)", "forward"),
    ),
    ("multiply_add_fusion.53", "f32[64,128,512]{2,1,0}", "jit(step)/optimizer_update/add", ("optimizer update", "-")),
    ("transpose_copy_fusion.3", "f32[64,4,32,64]{3,2,1,0}", f"{ODE_FWD}/add", ("layout copies", "forward")),
    (
        "multiply_tanh_fusion",
        "f32[64,64,512]{2,1,0}",
        f"{ODE_BWD}/jvp()/tanh",
        ("element-wise, loop and other", "recompute"),
    ),
]


@pytest.mark.parametrize("kernel, shape, op, expected", CASES, ids=[c[0] for c in CASES])
def test_each_kernel_is_placed_by_its_op_name(kernel, shape, op, expected):
    assert profile_step.classify(kernel, shape, op, mlp_dim=512) == expected


def test_hlo_metadata_reads_shape_and_op_name():
    hlo = (
        '  %ynn_fusion.1 = f32[4096,512]{1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="jit(step)/x/dot_general" '
        "stack_frame_id=3}\n"
        '  ROOT %tuple.9 = (f32[2]{0}) tuple(%c), metadata={op_name="jit(step)/y"}\n'
    )
    assert profile_step.hlo_metadata(hlo) == {
        "ynn_fusion.1": ("f32[4096,512]{1,0}", "jit(step)/x/dot_general"),
        "tuple.9": ("(f32[2]{0})", "jit(step)/y"),
    }
