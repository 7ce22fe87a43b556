"""Every private internal of a library kl_kernels relies on, one module per library.

* :mod:`kl_kernels._compat.torch`: torch's private Python APIs.
* :mod:`kl_kernels._compat.tensordict`: tensordict's storage internals (the TorchRL transforms'
  per-sample fast paths).
* :mod:`kl_kernels._compat.torchrl`: TorchRL's private helpers and the private methods of the loss
  class ``kl_kernels.torchrl.KLPENPPOLoss`` extends.

The C++ side keeps its equivalents in ``csrc/cpu/compat/``. Each entry is version-gated (looked up
once, with the torch versions it was checked on) and has a safe fallback for a torch without it;
``tests/test_compat.py`` runs every fallback. ``tests/test_compat.py`` also greps the package for
private uses outside these modules.
"""
