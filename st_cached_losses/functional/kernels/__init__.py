"""The loss stage's kernels: the tile building blocks every family reads its operands with
(``tiles``: operands tile by tile, a running log-sum-exp, the tile plan) and
the Triton kernels ([`triton_kernels`][st_cached_losses.functional.kernels.triton_kernels], imported only when Triton
is installed and a pass asks for them). Imports only the shared floor's precision."""
