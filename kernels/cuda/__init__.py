"""CUDA kernels (Triton) for the GPU path: fused MoE, FP8 block GEMM, MLA decode.

The backend module is `kernels.cuda.backend` (registered as "cuda" in kernels/__init__.py and
imported only on first use, so CPU-only machines never import Triton). This package init imports
nothing, so `kernels.cuda.tiles` is usable without Triton.
"""
