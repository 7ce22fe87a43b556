"""Drop-in replacements for TorchRL 0.14's LLM KL transforms, on the fused ``kl_reward``.

Each class subclasses TorchRL's, keeps its constructor (plus a keyword-only ``backend``), keys
and spec transforms, and replaces only the numeric step: one vectorized pass over the whole
batch instead of a Python loop over samples with ``masked_fill`` and ``pad_sequence``.
Every input layout TorchRL stores (dense padded, lazily stacked ragged, nested) is read once
into a dense or packed batch (``_io.py``) and written back the way it came.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torchrl.envs.llm.transforms import kl as _trl

# TorchRL's classes bound once, at import: nothing below looks them up on TorchRL's module at run
# time, so assigning ours to TorchRL's module attributes (``patch()``) cannot make a class call
# itself (that recursed before).
_TrlKLComputation = _trl.KLComputation
_TrlKLRewardTransform = _trl.KLRewardTransform
_TrlRetrieveLogProb = _trl.RetrieveLogProb
_TrlRetrieveKL = _trl.RetrieveKL
_TrlRayKLRewardTransform = _trl.RayKLRewardTransform
_TrlRayRetrieveKL = _trl.RayRetrieveKL

from .. import ragged
from ..kl_reward import kl_reward
from ..kl_reward.api import kl_reward_storing
from .actor_kl import ActorKLRewardTransform, is_probabilistic_actor
from ._io import Batch, has, put_entries, read, sample_leaves, shallow_copy, write

_ASSISTANT_MASK = ("masks", "all_assistant_mask")
_ATTENTION_MASK = ("masks", "all_attention_mask")
_PROMPT_TOKENS = ("tokens", "prompt")


def _is_llm_wrapper(obj) -> bool:
    """A TorchRL LLM wrapper (``TransformersWrapper``, ``vLLMWrapper``, ...: ``LLMWrapperBase``), or a
    module shaped like one (an ``input_mode``, as every LLM wrapper has and no probabilistic actor does)."""
    from torchrl.modules.llm.policies.common import LLMWrapperBase

    return isinstance(obj, LLMWrapperBase) or (isinstance(obj, torch.nn.Module) and hasattr(obj, "input_mode"))


def _check_pair(a: Batch, b: Batch, what: str, hint: str = "") -> None:
    """Same number of samples and same per-sample shapes, with TorchRL's wording."""
    if a.batch_size != b.batch_size:
        raise ValueError(f"Batch size mismatch: {what} has {a.batch_size} and {b.batch_size} samples")
    if a.dense != b.dense or (a.dense and a.values.shape != b.values.shape) or (
            not a.dense and not torch.equal(a.offsets, b.offsets.to(a.offsets.device))):
        for i, (sa, sb) in enumerate(zip(a.sample_shapes(), b.sample_shapes())):
            if sa != sb:
                raise ValueError(f"Sample {i} has different shapes in {what}: {tuple(sa)} and {tuple(sb)}.{hint}")
        raise ValueError(f"{what}: one is padded and the other ragged; both must use the same storage.{hint}")


def _reward_arg(reward: Batch | None, lp: Batch):
    """(reward for kl_reward, placement): per-token or per-sequence, checked as TorchRL checks it
    (a reward has one more trailing dimension than the log-probs)."""
    if reward is None:
        return None, "auto"
    lp_dims = lp.values.dim() - (0 if lp.dense else -1)  # per-sample dims + 1 (dense: batch dim)
    r_dims = reward.values.dim() - (0 if reward.dense else -1)
    if r_dims != lp_dims + 1:
        shape = reward.sample_shapes()[0] if reward.batch_size else reward.values.shape
        raise ValueError(f"The rewards have shape {tuple(shape)} but the kl has shape "
                         f"{tuple(lp.sample_shapes()[0]) if lp.batch_size else ()}. "
                         "The rewards should have one more dimension than the KL.")
    if reward.batch_size != lp.batch_size:
        raise ValueError(f"reward has {reward.batch_size} samples, the log-probs {lp.batch_size}")
    if reward.dense != lp.dense:
        # e.g. a dense [B, 1, 1] score next to lazily stacked log-probs: per sequence
        if reward.dense and reward.values.shape[1:] == (1, 1):
            return reward.values.reshape(-1), "sequence"
        raise ValueError("reward and log-probs must both be padded or both be ragged")
    if reward.dense:  # [B, T, 1] per token or [B, 1, 1] per sequence
        if reward.values.shape[1] == lp.values.shape[1]:
            return reward.values, "token"
        if reward.values.shape[1] == 1:
            return reward.values, "sequence"
        raise ValueError(f"reward of shape {tuple(reward.values.shape)} fits neither the tokens "
                         f"{tuple(lp.values.shape)} nor one value per sequence")
    # ragged: per sample [L, 1] (per token) or [1, 1] (per sequence), possibly mixed
    r_len = ragged.offsets_to_lengths(reward.offsets)
    lp_len = ragged.offsets_to_lengths(lp.offsets).to(r_len.device)
    if torch.equal(r_len, lp_len):
        return reward.values, "token"
    if bool((r_len == 1).all()):
        return reward.values.reshape(-1), "sequence"
    if not bool(((r_len == 1) | (r_len == lp_len)).all()):
        raise ValueError("each sample's reward must have one entry per token or one entry")
    # mixed: gather one value per token (a broadcast for the one-entry samples)
    offsets = lp.offsets.to(r_len.device)
    seq, pos = ragged.token_index(offsets, lp.values.shape[0])
    idx = reward.offsets.to(seq.device)[seq] + torch.where(r_len[seq] == 1, 0, pos)
    return reward.values[idx], "token"


def _with_trailing_dim(reward: torch.Tensor, lp: Batch) -> torch.Tensor:
    """The reward output with TorchRL's trailing dimension of 1 (``[..., T, 1]``)."""
    return reward if reward.dim() == lp.values.dim() + 1 else reward.unsqueeze(-1)


class KLComputation(_TrlKLComputation):
    """TorchRL's ``KLComputation`` on the fused kernel: ``kl = gen - ref`` (k1) per token, and
    optionally ``reward - coeff * kl``.

    Same arguments, keys, defaults and specs as ``torchrl.envs.llm.transforms.KLComputation``,
    plus ``backend`` (a ``kl_reward`` backend name). As in TorchRL, a NaN in either log-prob marks
    an alignment pad: its kl is 0. Inputs may be lazily stacked per-sample tensors, dense padded
    tensors or nested tensors (strided or jagged); the reward may be per token (``[L, 1]`` per
    sample, ``[B, T, 1]``) or per sequence (``[1, 1]`` per sample, ``[B, 1, 1]``).

    Example::

        >>> from tensordict import TensorDict, lazy_stack
        >>> td = lazy_stack([TensorDict({("log_probs", "full"): torch.zeros(n),
        ...                              ("ref_log_probs", "full"): torch.full((n,), -0.5),
        ...                              "reward": torch.ones(n, 1)}) for n in (3, 5)])
        >>> out = KLComputation(coeff=0.1)(td)
        >>> out[1]["reward"].squeeze(-1)
        tensor([0.9500, 0.9500, 0.9500, 0.9500, 0.9500])
    """

    def __init__(self, gen_log_probs_full_key=("log_probs", "full"), ref_log_probs_full_key=("ref_log_probs", "full"),
                 *, kl_key="kl_penalty", add_to_reward: bool = True, coeff: float = 1.0, padding_side: str = "left",
                 backend: str = "auto"):
        super().__init__(gen_log_probs_full_key, ref_log_probs_full_key, kl_key=kl_key, add_to_reward=add_to_reward,
                         coeff=coeff, padding_side=padding_side)
        self.backend = backend

    def _step(self, tensordict, next_tensordict):
        if self._step_samples(next_tensordict):
            return next_tensordict
        gen = read(next_tensordict, self.gen_log_probs_full_key)
        ref = read(next_tensordict, self.ref_log_probs_full_key)
        if gen is None or ref is None:
            raise ValueError(f"Log-probs not found. Expected keys: {self.gen_log_probs_full_key}, "
                             f"{self.ref_log_probs_full_key}")
        _check_pair(gen, ref, "gen_log_probs and ref_log_probs")
        reward = read(next_tensordict, "reward") if self.add_to_reward else None
        reward_arg, placement = _reward_arg(reward, gen)
        ref_values = ref.values.to(gen.values.device)
        out = kl_reward(gen.values, ref_values, reward_arg, coef=self.coeff, mask_nan=True,  # NaN = alignment pad
                        offsets=gen.offsets, reward_placement=placement, padding_side=self.padding_side,
                        detach=False, backend=self.backend)
        write(next_tensordict, self.kl_key, gen, out.kl)
        if reward is not None:
            write(next_tensordict, "reward", gen, _with_trailing_dim(out.reward, gen))
        return next_tensordict

    def _step_samples(self, td) -> bool:
        """The common ragged case, a lazy stack of plain samples with per-token rewards ``[L, 1]``:
        the per-sample tensors go to ``kl_reward`` as lists, which the CPU kernel reads in place
        (NaN pads masked in the kernel), and the results come back as per-sample views of one
        buffer. ``False`` (nothing done) for anything else, which the general path handles.

        This path's cost is per sample, so it finds the inputs and stores the results in the samples'
        entry dicts in C loops (``_io.sample_leaves``, ``_io.put_entries``) and leaves the checks to
        ``kl_reward`` (``problem.py``; its list reader reads each sample's facts in one C pass)."""
        if not isinstance(self.kl_key, str):
            return False
        keys = (self.gen_log_probs_full_key, self.ref_log_probs_full_key) + (("reward",) if self.add_to_reward else ())
        found = sample_leaves(td, keys)
        if found is None or not found[0]:
            return False
        entries, (gen, ref, *rest) = found
        reward = rest[0] if rest else None
        if reward is not None and isinstance(reward[0], torch.Tensor) and reward[0].dim() != 2:
            return False  # a reward [L] per sample: TorchRL's shape check belongs to the general path

        def store(out):
            # kl_reward took every input from one device and gave its results there: each sample,
            # holding inputs on that device, has no other device, so the results go in directly.
            # (This runs while the kernel may still be writing them: dict stores only.)
            put_entries(entries, self.kl_key, out.kl)
            if reward is not None:
                put_entries(entries, "reward", out.reward)

        try:
            kl_reward_storing(store, gen, ref, reward, coef=self.coeff, mask_nan=True, padding_side=self.padding_side,
                              reward_placement="token", detach=False, backend=self.backend)
        except (TypeError, ValueError):
            return False  # per-sequence or mixed rewards, mismatched shapes or devices: the general path
        return True


class KLRewardTransform(_TrlKLRewardTransform):
    """TorchRL's LLM ``KLRewardTransform`` on the fused kernel.

    Runs the reference model, then in one pass: masks both log-probs (assistant tokens, or the
    attention mask minus the prompt), ``kl = cur - ref`` (k1), ``reward - coef * kl`` and the masked
    reference log-probs. Outputs ``out_keys`` = (reward, ``"kl_penalty"``, ``"ref_log_prob"``), each
    ``[..., T, 1]`` in the input's storage (dense padded or per-sample ragged).

    Same constructor as TorchRL 0.14.1 plus ``detach`` (documented by TorchRL, default ``True``:
    outputs carry no gradient) and ``backend``. Fixed relative to TorchRL (see
    ``python_api/torchrl.md``): ``assistant_only=False`` and a missing reward work, ragged unpadded
    inputs work, and the prompt fallback skips the first prompt tokens of each sequence (not the
    first columns) under left padding.
    """

    def __new__(cls, *args, **kwargs):
        # One name for both signatures. TorchRL 0.14's is KLRewardTransform(ref_model=None, *,
        # ref_model_factory=None, ...): an LLM wrapper, positional or ref_model=, is this LLM form.
        # The seeds' TorchRL <= 0.10 form, KLRewardTransform(actor, coef=1.0, in_keys=None, out_keys=None,
        # requires_grad=False) (classic control), builds the actor-based transform: for actor=, or a
        # positional probabilistic actor that is not an LLM wrapper (TorchRL's LLM wrappers have
        # get_dist, in_keys and out_keys too, so the duck-typed actor check alone cannot tell them apart).
        first = args[0] if args else kwargs.get("actor", kwargs.get("ref_model"))
        llm_form = "ref_model" in kwargs or "ref_model_factory" in kwargs or _is_llm_wrapper(first)
        actor_form = "actor" in kwargs or (bool(args) and not llm_form)
        if cls is KLRewardTransform and actor_form and is_probabilistic_actor(first):
            if "actor" not in kwargs and args:
                kwargs["actor"], args = args[0], args[1:]
            return ActorKLRewardTransform(*args, **kwargs)
        if "actor" in kwargs:
            raise TypeError(f"KLRewardTransform(actor=...) needs a probabilistic actor with get_dist, got "
                            f"{type(kwargs['actor']).__name__}")
        if first is not None and not (isinstance(first, torch.nn.Module) or callable(first)):
            raise TypeError("KLRewardTransform takes a probabilistic actor (classic control) or a reference "
                            f"model wrapper (LLM) as its first argument, got {type(first).__name__}")
        return super().__new__(cls)

    def __init__(self, ref_model=None, *, ref_model_factory=None, coef=1.0, in_keys=None, out_keys=None,
                 log_prob_key=("log_probs", "full"), device=None, add_to_reward: bool = True, tokenizer=None,
                 assistant_only: bool = True, padding_side: str = "left", use_ray_service: bool = False,
                 detach: bool = True, backend: str = "auto"):
        super().__init__(ref_model, ref_model_factory=ref_model_factory, coef=coef, in_keys=in_keys,
                         out_keys=out_keys, log_prob_key=log_prob_key, device=device, add_to_reward=add_to_reward,
                         tokenizer=tokenizer, assistant_only=assistant_only, padding_side=padding_side,
                         use_ray_service=use_ray_service)
        self.detach = detach
        self.backend = backend

    @property
    def action_key(self):
        """TorchRL's: the parent env's input mode decides. A Ray actor running this class has no
        parent; its local wrapper pushes the key it read from its own parent (``_swap_remote_class``)."""
        pushed = self.__dict__.get("_remote_action_key")
        return pushed if pushed is not None else _TrlKLRewardTransform.action_key.fget(self)

    def _mask_args(self, tensordict, lp: Batch) -> dict:
        """kl_reward's mask / lengths / prompt_lens for the counted tokens."""
        if self.assistant_only:
            assistant = read(tensordict, _ASSISTANT_MASK)
            if assistant is not None:  # the common case: the attention mask is never read
                return {"mask": assistant.values.to(torch.bool)}
        attention = read(tensordict, _ATTENTION_MASK)
        if not self.assistant_only:
            return {"mask": attention.values.to(torch.bool)} if attention is not None else {}
        if attention is None:
            raise ValueError(f"assistant_only=True needs {_ASSISTANT_MASK} or, as a fallback, {_ATTENTION_MASK} "
                             f"and {_PROMPT_TOKENS} in the data")
        prompt = read(tensordict, _PROMPT_TOKENS)
        if prompt is None:
            raise ValueError(f"the assistant-mask fallback needs the prompt tokens {_PROMPT_TOKENS}")
        mask = attention.values.to(torch.bool)
        if lp.dense:
            # Every row's prompt is the padded prompt width, counted from the row's first real
            # token: under left padding that is after the padding, not column 0.
            batch = mask.shape[0]
            lengths = mask.sum(-1)
            prompt_lens = torch.full((batch,), prompt.values.shape[-1], dtype=torch.int64, device=mask.device)
            return {"mask": mask, "lengths": lengths, "prompt_lens": torch.minimum(prompt_lens, lengths)}
        prompt_lens = ragged.offsets_to_lengths(prompt.offsets).to(mask.device)
        lengths = ragged.offsets_to_lengths(lp.offsets).to(mask.device)
        return {"mask": mask, "prompt_lens": torch.minimum(prompt_lens, lengths)}

    def _step(self, tensordict, next_tensordict):
        io_device = getattr(self, "_io_device", None)
        original_device = None
        if io_device is not None:
            original_device = tensordict.device
            tensordict = tensordict.to(io_device)
            next_tensordict = next_tensordict.to(io_device)
        if not has(tensordict, self.action_key):  # (get() would try to stack a lazy stack's ragged entries)
            if not self.missing_tolerance:
                raise RuntimeError(f"Action with key {self.action_key} not found data {tensordict}")
            if self.out_keys[0] != "reward" and self.parent is not None:
                next_tensordict.set(self.out_keys[0], self.parent.reward_spec.zero())
            return next_tensordict
        with torch.device(io_device) if io_device is not None else nullcontext():
            ref_td = self.ref_model(shallow_copy(tensordict))
        ref = read(ref_td, self.log_prob_full_key)
        cur = read(tensordict, self.log_prob_full_key)
        if ref is None or cur is None:
            missing = "the reference model's output" if ref is None else "the data"
            raise ValueError(f"log-probs {self.log_prob_full_key} not found in {missing}")
        _check_pair(cur, ref, "the current and reference log-probabilities",
                    hint=" One possible reason is that the padding token is identical to the eos token, which means "
                         "that the eos_token log_prob is truncated from the reference model output.")
        reward = read(next_tensordict, self.in_keys[0]) if self.add_to_reward else None
        reward_arg, placement = _reward_arg(reward, cur)
        coef = self.coef.to(cur.values.device) if isinstance(self.coef, torch.Tensor) else self.coef
        out = kl_reward(cur.values, ref.values.to(cur.values.device), reward_arg, coef=coef,
                        offsets=cur.offsets, padding_side=self.padding_side, reward_placement=placement,
                        return_ref=True, detach=self.detach, backend=self.backend, **self._mask_args(tensordict, cur))
        if self.add_to_reward:
            write(next_tensordict, self.out_keys[0], cur, _with_trailing_dim(out.reward, cur))
        write(next_tensordict, self.out_keys[1], cur, out.kl.unsqueeze(-1))
        write(next_tensordict, self.out_keys[2], cur, out.ref_log_probs.unsqueeze(-1))
        if original_device is not None:
            next_tensordict = next_tensordict.to(original_device)
        return next_tensordict


class RetrieveLogProb(_TrlRetrieveLogProb):
    """TorchRL's ``RetrieveLogProb`` with vectorized assistant masking and a working ``detach``.

    Same constructor as TorchRL 0.14.1. Masking zeroes the non-assistant tokens of the whole batch
    in one op (no loop over samples) before padding or nesting the result as the model's
    ``pad_output``/``layout`` say. ``detach=True`` (TorchRL's documented default, ignored by
    TorchRL) stores log-probs without gradient history.
    """

    def _mask_assistant_tokens(self, td, lp_key):
        io_device = getattr(self, "_io_device", None)
        with torch.device(io_device) if io_device is not None else nullcontext():
            lp = read(td, lp_key)
            mask = read(td, _ASSISTANT_MASK)
            if lp is None or mask is None:
                raise ValueError(f"assistant masking needs {lp_key} and {_ASSISTANT_MASK} in the data")
            _check_pair(lp, mask, "log-probs and assistant mask")
            values = lp.values.masked_fill(~mask.values.to(torch.bool), 0.0)
            if lp.dense:
                return values
            if self.model.pad_output:
                return ragged.to_padded(values, lp.offsets, padding_side=self.padding_side, padding_value=0.0)
            return ragged.to_nested(values, lp.offsets, layout=self.model.layout)

    def transform_observation_spec(self, observation_spec):
        """Registers the key this transform writes, the per-token log-probs (``[*batch, -1]``, ragged
        like the env's token specs), so an env that checks its outputs (``TransformedEnv(ChatEnv)``
        with a generating policy) accepts them. TorchRL 0.14.1's registers ``"kl_penalty"``, which it
        never writes, and not its log-probs."""
        from torchrl.data import Unbounded

        observation_spec[self.log_probs_full_key] = Unbounded(
            shape=(*observation_spec.shape, -1), dtype=torch.get_default_dtype(), device=observation_spec.device)
        return observation_spec

    def _step(self, tensordict, next_tensordict):
        next_tensordict = super()._step(tensordict, next_tensordict)
        if self.detach:
            lp = read(next_tensordict, self.log_probs_full_key)
            if lp is not None and lp.values.requires_grad:
                write(next_tensordict, self.log_probs_full_key, lp, lp.values.detach())
        return next_tensordict


def _ours(t):
    """Our twin of a transform TorchRL's RetrieveKL built (same settings)."""
    if isinstance(t, _TrlRetrieveLogProb) and not isinstance(t, RetrieveLogProb):
        return RetrieveLogProb(t.model, log_probs_full_key=t.log_probs_full_key, assistant_only=t.assistant_only,
                               tokenizer_kwargs=dict(t.tokenizer_kwargs), detach=t.detach,
                               device=getattr(t, "_io_device", None), tokenizer=t.tokenizer,
                               padding_side=t.padding_side)
    if isinstance(t, _TrlKLComputation) and not isinstance(t, KLComputation):
        return KLComputation(t.gen_log_probs_full_key, t.ref_log_probs_full_key, kl_key=t.kl_key,
                             add_to_reward=t.add_to_reward, coeff=t.coeff, padding_side=t.padding_side)
    return t


class RetrieveKL(_TrlRetrieveKL):
    """TorchRL's ``RetrieveKL`` (two ``RetrieveLogProb`` and a ``KLComputation`` in a ``Compose``)
    built from this module's classes. Same constructor, validation and lazy ``"from_collector"``
    initialization as TorchRL 0.14.1."""

    def __init__(self, gen_model="from_collector", ref_model=None, **kwargs):
        super().__init__(gen_model, ref_model, **kwargs)
        self._swap_in_ours()

    def _swap_in_ours(self):
        if getattr(self, "_initialized", True):
            ours = [_ours(t) for t in self.transforms]
            self.transforms = torch.nn.ModuleList()
            for t in ours:
                t.set_container(self)
                self.transforms.append(t)

    def _init_deferred(self):
        super()._init_deferred()
        self._swap_in_ours()


def _swap_remote_class(ray_transform_cls, ours):
    """A TorchRL Ray transform class whose remote actor runs ``ours`` instead of TorchRL's class."""

    class Swapped(ray_transform_cls):
        def _create_actor(self, **kwargs):
            real = self._ray

            class _Ray:  # TorchRL's _create_actor calls self._ray.remote(...)(TheirClass)
                def __getattr__(self, name):
                    return getattr(real, name)

                def remote(self, *args, **kw):
                    decorate = real.remote(*args, **kw)
                    return lambda _theirs: decorate(ours)

            self._ray = _Ray()
            try:
                return super()._create_actor(**kwargs)
            finally:
                self._ray = real

        def set_container(self, container):
            # TorchRL's KLRewardTransform reads its action key from the parent env, which only this
            # local wrapper has: in TorchRL 0.14.1 every _step on the actor fails on it. Read it
            # here, as TorchRL's property would, and hand it to the actor (ours takes it).
            result = super().set_container(container)
            if issubclass(ours, _TrlKLRewardTransform) and getattr(self.parent, "base_env", None) is not None:
                try:
                    key = _TrlKLRewardTransform.action_key.fget(self)
                except (AttributeError, ValueError):
                    return result  # not an LLM env (no input mode): the actor fails at its step, as TorchRL's
                self._ray.get(self._actor._set_attr.remote("_remote_action_key", key))
            return result

    Swapped.__name__ = Swapped.__qualname__ = ray_transform_cls.__name__
    return Swapped


# use_ray_service=True goes through TorchRL's own Ray machinery, with our classes on the actor.
KLRewardTransform._RayServiceClass = _swap_remote_class(_TrlRayKLRewardTransform, KLRewardTransform)
RetrieveKL._RayServiceClass = _swap_remote_class(_TrlRayRetrieveKL, RetrieveKL)
