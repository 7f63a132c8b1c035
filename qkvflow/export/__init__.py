"""From a trained DiffEqFormer to other formats.

* `discretise`: the ODE model at M step times as an ordinary M-layer parallel transformer (dt folded in);
* `hf_folder`: a Hugging Face folder (config, safetensors, tokenizer, the torch twin's code);
* `hf`: the torch twin that the folder ships (`trust_remote_code`), and its configuration classes;
* `ode`: the continuous model itself (hypernetwork weights, no discretisation).
* `run`: what `qkvflow export` runs: a run's checkpoint loaded, discretised and written as a folder.
"""
