"""Benchmark harness behind ``kl-kernels bench`` (the committed results live in ``bench/``).

* ``machine.py``   provenance (CPU/GPU, versions, commit) and the measured copy bandwidth
* ``timing.py``    the timer (warm-up, repeats, median; synchronizes on CUDA)
* ``batches.py``   realistic RLHF-shaped batches (documented length and mask distribution)
* ``kl_reward.py`` the kl_reward cases: our backends vs eager per-sample code vs torch.compile
* ``report.py``    tables, JSON, CSV and the PNG plot
"""
