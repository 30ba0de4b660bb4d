"""The layers of the Hugging Face `kernels` layout (`make kernels-build`):
`kernels.kernelize` maps transformers' layer of the same name to the one
here, whose forward replaces that layer's (stateless, no constructor
arguments: the `kernels` package's rules)."""
from .hf import MultiScaleDeformableAttentionKernel as MultiScaleDeformableAttention

__all__ = ["MultiScaleDeformableAttention"]
