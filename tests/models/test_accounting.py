import pytest

from qkvflow.cli.describe import DescribeConfig, describe
from qkvflow.models.accounting import parameter_counts
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config

GPT2_VOCAB = 50257


def medium(d_emb: int) -> DiffEqFormerGpt2Config:
    # The paper's medium architecture: hidden 1024, 16 heads, seq 1024, 128 frequencies.
    return DiffEqFormerGpt2Config(max_seq_len=1024, hidden_dim=1024, num_heads=16, time_embed_dim=d_emb)


def test_parameter_slope_and_paper_table6():
    low, high = parameter_counts(medium(20), GPT2_VOCAB), parameter_counts(medium(144), GPT2_VOCAB)
    slope = (high["total_params"] - low["total_params"]) / (144 - 20)
    # Each unit of d_emb adds one projection row per layer weight: 4*1024^2 + 2*1024*4096 = 12.58M.
    assert slope == pytest.approx(12.58e6, rel=0.005)
    # Table 6 of the paper: about 300M parameters at d_emb 20 and 1860M at d_emb 144.
    assert low["total_params"] == pytest.approx(300e6, rel=0.03)
    assert high["total_params"] == pytest.approx(1860e6, rel=0.03)
    # Embeddings: tied GPT-2 vocabulary plus 1024 learned positions.
    assert low["embedding_params"] == GPT2_VOCAB * 1024 + 1024 * 1024
    assert high["hypernetwork_params"] > 0.97 * high["total_params"]


def test_describe_counts_baselines_and_flops():
    from levanter.models.gpt2 import Gpt2Config

    gpt = describe(
        DescribeConfig(model=Gpt2Config(max_seq_len=64, hidden_dim=128, num_heads=4, num_layers=4), vocab_size=65)
    )
    # 4 layers of 12*h^2 + biases/norms 13h, plus embeddings and final norm
    h = 128
    expected = 4 * (12 * h * h + 13 * h) + 65 * h + 64 * h + 2 * h
    assert gpt["total_params"] == expected and gpt["hypernetwork_params"] == 0
    ode = describe(
        DescribeConfig(model=DiffEqFormerGpt2Config(max_seq_len=64, hidden_dim=128, num_heads=4), vocab_size=65)
    )
    assert ode["ode_evaluations"] == 12
    # same field cost per evaluation as a GPT layer: FLOPs scale with evaluations, not parameters
    per_layer = (gpt["forward_flops_per_token"] - 2 * h * 65) / 4
    assert ode["forward_flops_per_token"] == pytest.approx(12 * per_layer + 2 * h * 65)
