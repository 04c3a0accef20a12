"""The backends of ``impl=``: the XLA path and the Pallas kernels (the loss and the fused head), and the
vocab-parallel steps over them."""
