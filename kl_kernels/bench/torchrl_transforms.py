"""Benchmark of whole transform calls: ``kl_kernels.torchrl`` against TorchRL 0.14's classes.

Each contender is a full ``_step``/``forward`` call on a TensorDict batch, as an environment or a
data pipeline makes it, timed side by side with TorchRL's class on the modes where TorchRL works:

* ``KLRewardTransform`` on a dense left-padded batch: assistant mask, a per-sequence score
  ``[B, 1, 1]``. The reference "model" hands back stored reference log-probs, so the timing is the
  transform's own work, not a forward pass.
* ``KLComputation`` on a lazy stack of per-sample tensors (k1, per-token reward ``[L, 1]``), next
  to ``per-sample floor``: the part of such a call that no implementation storing TorchRL's
  per-sample outputs avoids (see :func:`per_sample_floor`), timed in the same rounds.

Ours also runs ``KLRewardTransform`` on a lazy stack of ragged samples, where TorchRL fails; that
row has no TorchRL baseline. Skipped when torchrl is not installed.
"""

from __future__ import annotations

import warnings

import torch

from .. import ragged
from .batches import RLHFBatch
from .contenders import Contender, is_copy, set_speedup
from .kl_reward import COEF, _time_rows

TASK = "TorchRL transform call task"
FLOOR = "per-sample floor (no math)"
OUT_REWARD = "penalized_reward"


class _StoredRef(torch.nn.Module):
    """A reference 'model' that writes precomputed log-probs: the interface TorchRL's transform
    uses (``in_keys``, ``pad_output``, ``input_mode``, ``generate``), none of a model's cost."""

    def __init__(self, ref, pad_output: bool):
        super().__init__()
        self.ref = ref
        self.pad_output = pad_output
        self.in_keys = [("tokens", "full")]
        self.out_keys = [("log_probs", "full")]
        self.input_mode = "tokens"
        self.generate = False
        self.return_log_probs = True

    def forward(self, td):
        if self.pad_output:
            td.set(("log_probs", "full"), self.ref)
        else:
            for sub, r in zip(td.tensordicts, self.ref):
                sub.set(("log_probs", "full"), r)
        return td


def _with_action_key(cls):
    # Outside an environment TorchRL's transform cannot find its action key: fix it, for both.
    return type(cls.__name__, (cls,), {"action_key": ("tokens", "full")})


def run_task(ctx) -> list[dict]:
    """The ``torchrl`` task of ``kl-kernels bench`` (:mod:`kl_kernels.bench.tasks`): :func:`run` per size."""
    return ctx.per_size(run)


def run(batch: RLHFBatch, *, copy_gbs: float, repeats: int, budget_s: float, progress=None,
        retime: bool = True) -> list[dict]:
    try:
        from tensordict import TensorDict, lazy_stack
        from torchrl.envs.llm.transforms import kl as trl

        from .. import torchrl as ours
    except ImportError:
        if progress:
            progress("torchrl/tensordict not installed: skipping the transform comparison")
        return []
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    b, dev = batch.size.batch, batch.lp.device
    width = batch.lp_padded.shape[1]
    tokens = torch.zeros(b, width, dtype=torch.long, device=dev)
    dense = TensorDict({("tokens", "full"): tokens, ("log_probs", "full"): batch.lp_padded,
                        ("masks", "all_assistant_mask"): batch.mask_padded}, batch_size=(b,), device=dev)
    dense_next = TensorDict({"reward": batch.score.view(b, 1, 1)}, batch_size=(b,), device=dev)
    # The penalized reward goes to its own key, so a call never reads an earlier call's output and
    # the timed loop needs no copies of the inputs (TorchRL supports custom out_keys).
    keys = dict(in_keys=["reward"], out_keys=[OUT_REWARD, "kl_penalty", "ref_log_probs"], coef=COEF)
    theirs_dense = _with_action_key(trl.KLRewardTransform)(_StoredRef(batch.ref_padded, True), **keys)
    ours_dense = _with_action_key(ours.KLRewardTransform)(_StoredRef(batch.ref_padded, True), **keys)

    lp_list, ref_list = ragged.to_list(batch.lp, batch.offsets), ragged.to_list(batch.ref, batch.offsets)
    mask_list = ragged.to_list(batch.mask, batch.offsets)
    lazy = lazy_stack([TensorDict({("tokens", "full"): torch.zeros(lp.shape[0], dtype=torch.long, device=dev),
                                   ("log_probs", "full"): lp, ("masks", "all_assistant_mask"): m}, batch_size=())
                       for lp, m in zip(lp_list, mask_list)])
    lazy_next = lazy_stack([TensorDict({"reward": s.view(1, 1)}, batch_size=()) for s in batch.score])
    ours_lazy = _with_action_key(ours.KLRewardTransform)(_StoredRef(ref_list, False), **keys)

    rewards = [torch.zeros(t.shape[0], 1, device=dev) for t in lp_list]
    klc_td = lazy_stack([TensorDict({("log_probs", "full"): a, ("ref_log_probs", "full"): r, "reward": w},
                                    batch_size=()) for a, r, w in zip(lp_list, ref_list, rewards)])
    theirs_klc, ours_klc = trl.KLComputation(coeff=COEF), ours.KLComputation(coeff=COEF)

    # The timed calls return the TensorDict; reading results out of it (a torch.cat for lazy stacks)
    # happens only for the correctness check, outside the timing.
    dense_out = lambda td: _outs(td, padded=True)  # noqa: E731
    lazy_out = lambda td: _outs(td, padded=False)  # noqa: E731
    klc_out = lambda td: (torch.cat(list(td.get("kl_penalty", as_list=True))), None, None)  # noqa: E731
    # Every contender writes into its own containers (TensorDict.copy(): new containers, the same input
    # tensors), so a call only ever replaces, and frees, what the same contender stored the call before.
    # With shared containers a call would free whatever the previous contender had stored there, and the
    # two KLComputations store very different things (TorchRL: B separately allocated results per key;
    # ours: B views of one buffer): measured on the 2-core VM at B = 256, freeing TorchRL's results added
    # ~0.14 ms (~18%) to our call in the rounds where TorchRL's ran first.
    theirs_dense_next, ours_dense_next = dense_next.copy(), dense_next.copy()
    theirs_klc_td, ours_klc_td = klc_td.copy(), klc_td.copy()
    candidates = [
        Contender("TorchRL KLRewardTransform", "padded", lambda: theirs_dense._step(dense, theirs_dense_next),
                  extract=dense_out),
        Contender("kl_kernels.torchrl.KLRewardTransform", "padded", lambda: ours_dense._step(dense, ours_dense_next),
                  extract=dense_out),
        Contender("kl_kernels.torchrl.KLRewardTransform", "list", lambda: ours_lazy._step(lazy, lazy_next),
                  extract=lazy_out),
        # KLComputation writes kl_penalty and reward back into its input: re-running repeats the same work
        Contender("TorchRL KLComputation", "list (KLComputation)", lambda: theirs_klc(theirs_klc_td),
                  extract=klc_out),
        Contender("kl_kernels.torchrl.KLComputation", "list (KLComputation)", lambda: ours_klc(ours_klc_td),
                  extract=klc_out),
        Contender(FLOOR, "list (KLComputation)", per_sample_floor(klc_td, batch),
                  unchecked="a floor: it computes nothing", moves_bytes=False),
    ]
    want = _outs(theirs_dense._step(dense, dense_next), padded=True)
    packed_want = tuple(None if x is None else _packed(x, batch) for x in want)
    refs = {"padded": want, "list": packed_want,
            "list (KLComputation)": (torch.cat(list(theirs_klc(klc_td.clone()).get("kl_penalty", as_list=True))),
                                     None, None)}
    s = batch.lp.element_size()

    def nbytes(layout):
        elems = batch.lp_padded.numel() if layout == "padded" else batch.num_tokens
        if layout == "list (KLComputation)":
            return batch.num_tokens * (2 * s + 4 + s + 4)
        return elems * (2 * s + 1) + elems * (2 * s + 4) + b * 4  # read lp, ref, mask; write kl, ref, reward
    rows = _time_rows(batch, TASK, candidates, refs, nbytes, copy_gbs, repeats, budget_s, progress, None, retime)
    base = {"padded": rows[0], "list": rows[0], "list (KLComputation)": rows[3]}
    for r in rows:
        r["baseline"] = "TorchRL KLComputation" if "KLComputation" in r["layout"] else "TorchRL KLRewardTransform (padded)"
        if not is_copy(r):
            set_speedup(r, "x_vs_baseline", base[r["layout"]])
    return rows


def per_sample_floor(td, batch: RLHFBatch):
    """A callable doing what any ``KLComputation`` call on the lazy stack ``td`` must do besides the
    math: for every sample, find its three inputs (two log-probs, the reward) and read each one's
    address, then store two per-sample results (views of one buffer each, made per call) under
    ``kl_penalty`` and ``reward``. Nothing is checked or computed; the buffers are allocated once.

    A transform call touches the Python objects of every sample (containers, tensors, views), and
    after other work (a model forward; in the benchmark, the contender before) those are out of the
    caches: on the 2-core CI VM that costs ~1-3 us a sample whatever the implementation, as much as
    a tenth of TorchRL's whole call at B = 256. Its time next to ours and TorchRL's shows how much of
    a call is that floor. It runs on its own containers (a shallow copy of ``td``: same tensors), so
    its outputs never become another contender's inputs."""
    from ..torchrl import _io

    work = _io.shallow_copy(td)
    lengths = ragged.offsets_to_lengths(batch.offsets).tolist()
    kl = torch.zeros(batch.num_tokens, dtype=batch.lp.dtype, device=batch.lp.device)
    reward = torch.zeros(batch.num_tokens, 1, dtype=torch.float32, device=batch.lp.device)

    def call():
        # the three inputs of each sample, found as our transform finds them, and their addresses
        entries, leaves = _io.sample_leaves(work, (("log_probs", "full"), ("ref_log_probs", "full"), "reward"))
        for tensors in leaves:
            for t in tensors:
                t.data_ptr()
        # and two per-sample results stored the way our transform stores them
        _io.put_entries(entries, "kl_penalty", list(torch.unsafe_split_with_sizes(kl, lengths)))
        _io.put_entries(entries, "reward", list(torch.unsafe_split_with_sizes(reward, lengths)))
        return work
    return call


def _outs(td, padded: bool) -> tuple:
    """(kl, reward, ref) of a KLRewardTransform output: dense [B, T] or packed [N]."""
    keys = ("kl_penalty", OUT_REWARD, "ref_log_probs")
    if padded:
        return tuple(td.get(k).squeeze(-1) for k in keys)
    return tuple(torch.cat(list(td.get(k, as_list=True))).squeeze(-1) for k in keys)


def _packed(x: torch.Tensor, batch: RLHFBatch) -> torch.Tensor:
    return ragged.from_padded(x, batch.lengths, padding_side="left").values
