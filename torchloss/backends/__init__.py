"""The backends of ``impl=``: the torch path (with its CPU tiling) and the Triton kernels (the loss, the fused
head and its bf16 matmuls), and the vocab-parallel steps over them."""
