"""Triton kernels for what FlashInfer does not cover: head_dim-512 / K=V paged attention (paged_attention)
and the Gemma 4 routed-expert path (moe). Import the submodules directly; this package imports nothing
eagerly so that importing it never compiles or touches a GPU."""
