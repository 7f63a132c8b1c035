"""Related designs, beside the DiffEqFormer: the N-ODE Transformer (`node_transformer`, `node_lm`),
TransEvolve (`transevolve`), the Depth-Adaptive Transformer's exits and halting (`adaptive`, `halting`) and
its exits carried to continuous depth (`ode_exits`). docs/related.md describes each; `qkvflow.models`
imports the families among them, so their `type:` names parse like the DiffEqFormer's."""
