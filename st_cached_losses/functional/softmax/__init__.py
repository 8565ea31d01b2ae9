"""The InfoNCE family: a softmax over each row's logit terms ([`terms`][st_cached_losses.functional.softmax.terms]),
its options, its entry points ([`loss`][st_cached_losses.functional.softmax.loss]: ``infonce``,
``infonce_loss_and_grad``), its drivers (local, own, ring, across processes), its autograd Function and its passes on
the Triton kernels. Imports the shared floor, the kernels and the representations, never the sigmoid family.

The package's face names the entry points ``st_cached_losses.functional.infonce`` and
``st_cached_losses.functional.infonce_loss_and_grad``; this room is named for the family's link function
(``softmax``, beside ``sigmoid``), so that no module path collides with the function ``infonce``."""
