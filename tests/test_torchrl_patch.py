"""kl_kernels.torchrl.patch(): ours in TorchRL's own modules, then TorchRL's env machinery.

Runs in a subprocess so the patched TorchRL modules never leak into other tests. Before our
classes bound their TorchRL bases at import, ``action_key`` looked ``_trl.KLRewardTransform`` up on
the (patched) module at run time and recursed (``RecursionError`` in ``TransformedEnv``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torchrl")

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import functools, torch
    import torchrl.envs.llm as llm
    import torchrl.envs.llm.transforms as llm_t
    import torchrl.envs.llm.transforms.kl as kl
    from torchrl.envs import TransformedEnv, Compose
    import kl_kernels.torchrl as ours
    from torchrl_models import TinyLM

    names = ["KLRewardTransform", "KLComputation", "RetrieveLogProb", "RetrieveKL"]
    orig = {n: getattr(kl, n) for n in names}
    replaced = ours.patch()
    want = sorted(f"{m}.{n}" for m in ("torchrl.envs.llm.transforms.kl", "torchrl.envs.llm.transforms",
                                       "torchrl.envs.llm") for n in names)
    assert sorted(replaced) == want, replaced
    assert ours.patch() == []  # idempotent
    for mod in (kl, llm_t, llm):
        for n in names:
            assert getattr(mod, n) is getattr(ours, n), (mod, n)

    # TorchRL code using its own (now patched) names
    t = llm.KLRewardTransform(TinyLM(seed=2), coef=0.2)
    env = TransformedEnv(llm.ChatEnv(batch_size=(2,), input_mode="tokens"), t)
    assert t.action_key == ("tokens", "full")
    env2 = TransformedEnv(llm.ChatEnv(batch_size=(2,), input_mode="tokens"))
    env2.append_transform(llm.KLRewardTransform(TinyLM(seed=2)))
    assert env2.transform[0].action_key == ("tokens", "full")
    env3 = TransformedEnv(llm.ChatEnv(batch_size=(2,), input_mode="tokens"), Compose())
    env3.transform.append(llm.KLRewardTransform(TinyLM(seed=2)))
    assert env3.transform[0].action_key == ("tokens", "full")
    rkl = llm.RetrieveKL(TinyLM(seed=1, input_mode="history", log_probs_key="log_probs"),
                         TinyLM(seed=2, input_mode="history", log_probs_key="ref_log_probs"))
    assert all(type(x).__module__.startswith("kl_kernels") for x in rkl.transforms), rkl.transforms
    TransformedEnv(llm.ChatEnv(batch_size=(2,), input_mode="history"), rkl)

    restored = ours.unpatch()
    assert sorted(restored) == want, restored
    assert ours.unpatch() == []
    for mod in (kl, llm_t, llm):
        for n in names:
            assert getattr(mod, n) is orig[n], (mod, n)
    print("OK")
""")


def test_patch_then_torchrl_env_machinery_and_unpatch():
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-6000:]
