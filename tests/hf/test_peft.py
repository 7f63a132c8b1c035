"""The LoRA hand-off: a Levanter LoRA on the discrete model, saved with `save_peft_pretrained`, loads
with PEFT onto the exported torch base model and gives the JAX LoRA model's logits."""

import numpy as np
import pytest

from tests.helpers import logit_tolerance, random_tokens, tiny_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_levanter_lora_loads_in_peft_on_the_export(tmp_path, flavour):
    import jax.random as jrandom
    import torch
    from levanter.adaptor.lora import LoraConfig, loraize, save_peft_pretrained
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qkvflow.export.hf_folder import save_hf_folder
    from qkvflow.models.discretise import discretise
    from tests.analysis.builders import filled

    config = tiny_config(flavour)
    discrete = discretise(filled(config, std=0.1), 3)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    base_dir.mkdir()
    save_hf_folder(discrete, str(base_dir))

    # a_init_mode "random": both factors random, so B @ A != 0 and the adapter changes the logits (the
    # default, "zero", starts as the identity, and the comparison below would not test the adapter).
    # alpha / r = 0.25 makes (alpha / r) B @ A a few times the base projections (std 0.04 against 0.01 to
    # 0.02), as large as a trained adapter may get: the logits stay as well conditioned as the export
    # tests' models, whose round-off logit_tolerance describes. alpha = 4 (std 0.33, 20 times the base
    # weights) amplified the round-off about 15 times: 2.6e-6 on one CPU, 9.2e-6 on another, 4.67e-6 allowed.
    lora_config = LoraConfig(target_modules=TARGETS, r=2, alpha=0.5, a_init_mode="random")
    lora_model = loraize(discrete, lora_config, key=jrandom.PRNGKey(3))
    save_peft_pretrained(lora_model, lora_config, str(base_dir), str(adapter_dir), prefix="base_model.model")

    tokens = random_tokens(config)
    expected = np.asarray(lora_model(tokens).array)
    assert np.abs(expected - np.asarray(discrete(tokens).array)).max() > 1e-3  # the adapter does something

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), trust_remote_code=True)
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = peft_model(torch.tensor(np.asarray(tokens.array))).logits.numpy()
    # 3 layers plus the rank-2 adapter's product: float32 round-off (tests/helpers.py); measured 1.9e-7
    # (gpt2) and 2.9e-7 (llama) on a 2-core AMD EPYC (AVX2), against 4.7e-6
    assert np.abs(logits - expected).max() / np.abs(expected).max() < logit_tolerance(3, config.hidden_dim)
