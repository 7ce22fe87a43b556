"""Every private internal of a library kl_kernels relies on, one module per library.

* :mod:`kl_kernels._compat.torch`: torch's private Python APIs.

The C++ side keeps its equivalents in ``csrc/cpu/compat/``. Each entry is version-gated (looked up
once, with the torch versions it was checked on) and has a safe fallback for a torch without it;
``tests/test_compat.py`` runs every fallback. ``tests/test_compat.py`` also greps the package for
private uses outside these modules.
"""
