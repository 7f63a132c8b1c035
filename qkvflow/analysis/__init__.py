"""Analyses of trained models, after section 4 and appendices B, C.8 and F of the paper
(Tong et al., "Neural ODE Transformers: Analyzing Internal Dynamics and Adaptive Fine-tuning",
ICLR 2025). `qkvflow analyze` (qkvflow/cli/analyze.py) runs them from the command line.

| module | what |
|---|---|
| `circuits` | per-head Q, K, V, O matrices along depth (time t, or layer index for Levanter models) |
| `spectra` | eigenvalues of the QK and OV circuits along depth, their relative variation (Fig. 2a-b) |
| `tangent` | Lyapunov exponents of dY/dt = J(t) Y by Euler steps with QR re-orthonormalisation |
| `lyapunov` | token sensitivity: the exponent of each input token for the last token (eq. 7, Fig. 3) |
| `attention_maps` | per-head attention probabilities along the trajectory (appendix F) |
| `token_figures` | the HTML page and PNGs of token sensitivities and attention maps |
| `clusters` | the attention-only particle system with time-scaled weights (appendix C.8) |
"""
