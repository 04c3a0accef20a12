"""A tiny causal LM defined once in Flax NNX and once in torch, trained identically with the
masked losses of this project (issue: end-to-end parity). See ``demo.py``."""
