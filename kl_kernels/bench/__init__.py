"""Benchmark harness behind ``kl-kernels bench`` (the committed results live in ``bench/``).

* ``machine.py``   provenance (CPU/GPU, versions, commit) and the measured copy bandwidth
* ``timing.py``    the timer (warm-up, repeats, median; synchronizes on CUDA)
* ``batches.py``   realistic RLHF-shaped batches (documented length and mask distribution)
* ``contenders.py`` a table's contenders timed side by side with a copy of the same bytes; its rows
* ``kl_reward.py`` the kl_reward cases: our backends vs eager per-sample code vs torch.compile
* ``torchrl_transforms.py`` whole transform calls: kl_kernels.torchrl vs TorchRL's classes
* ``kl_penalty.py`` the PPO loss, forward + backward: ours vs eager autograd vs torch.compile
* ``report.py``    tables, JSON, CSV and the PNG plot
"""
