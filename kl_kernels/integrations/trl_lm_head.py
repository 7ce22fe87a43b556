"""TRL 1.16's fused LM head, computed by :func:`kl_kernels.linear_token_logprobs`.

TRL's ``GRPOTrainer`` patches the policy (its base model under PEFT) and the reference model with
``trl.trainer.utils.add_fused_lm_head``: ``model(..., labels=labels, fused_lm_head=True)`` then runs the
backbone and returns TRL's ``FusedCausalLMOutput`` (per-token ``log_probs`` and ``entropy`` of the next-token
labels, 0 where the label is ``-100``, ``label_mask``, ``loss``) from the last hidden states and the head,
without the ``[B, T, V]`` logits. :func:`add_fused_lm_head` (the same signature) and :func:`patch_lm_head`
(a constructed trainer) put ``linear_token_logprobs`` under that call, for the same outputs::

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), ...)
    patch_lm_head(trainer)          # or kl_kernels.integrations.trl's switch with lm_head="kl_kernels"

What TRL's head does, and what this one does with it:

* labels: rolled by one (``labels[:, 1:]`` against the hidden states ``[:, :-1]``), or pre-shifted
  ``shift_labels`` scored as given; only positions whose label is not ``-100`` are scored (the hidden states
  of those rows go to the op, the results are scattered back, zeros elsewhere);
* the logits ``z = softcap * tanh(logit_scale * (h @ W.T + b) / softcap) / temperature``: TRL's
  ``temperature``, the config's logit scale (``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``,
  ``logits_scaling``: read by TRL's rule, :func:`config_logit_transform`) and ``final_logit_softcapping``,
  handed to the op's ``logit_scale=`` / ``softcap=``;
* the computing dtype: the autocast dtype when autocast is on, else the hidden states'; with
  ``cast_lm_head_to_fp32`` the hidden states and the head in float32, autocast off;
* gradients to the hidden states (so to the backbone), the head's weight and bias, through log-probs and entropy;
* ``loss`` (``-sum log_probs / count``, or ``/ num_items_in_batch``) and ``label_mask``, as TRL's.

Handed to TRL's own head, with **one** warning naming the option (never silently different): a logit scale
``<= 0``, a soft-cap or a scale this kl_kernels' ``linear_token_logprobs`` cannot take, per-token outputs
besides ``log_probs`` and ``entropy`` (``log_sum_sq_probs``, ``mean_logits``, ``is_top1``), MoE models
(``output_router_logits``: TRL adds the router's load-balancing loss), DeepSpeed ZeRO-3 (a partitioned
head) and, found at the call, an FSDP2 (DTensor) head. TRL is imported when a head is added, not with
this module.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import types
import warnings

import torch

# Per-token fields TRL's head can return; ours computes these two
OURS_OUTPUTS = ("log_probs", "entropy")


def config_logit_transform(config) -> tuple[float, float | None]:
    """``(logit_scale, final_logit_softcapping)`` of a model config, read as TRL 1.16's
    ``add_fused_lm_head`` reads them (its text config; ``logit_scale``, else ``output_multiplier``, else
    ``lm_head_multiplier``, else ``1 / logits_scaling`` (HyperCLOVA X: ``logits_scaling``); none: 1.0)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(text_config, name, None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if getattr(text_config, "model_type", None) == "hyperclovax" else 1 / scaling
    return (1.0 if scale is None else scale), softcap


def _op_takes_transform() -> bool:
    from ..token_logprobs.linear import linear_token_logprobs

    params = inspect.signature(linear_token_logprobs).parameters
    return "logit_scale" in params and "softcap" in params


def unfused_reason(model, outputs=("log_probs",)) -> str | None:
    """Why TRL's own head must compute for ``model`` (a sentence naming the option), or None when ours can."""
    text_config = model.config.get_text_config()
    extra = [o for o in outputs if o not in OURS_OUTPUTS]
    if extra:
        return f"outputs={tuple(outputs)!r}: {', '.join(extra)} are computed by TRL's head only"
    if hasattr(text_config, "output_router_logits"):
        return ("output_router_logits (a Mixture-of-Experts model: TRL's head adds the router's load-balancing loss "
                "from the backbone's router logits)")
    scale, softcap = config_logit_transform(model.config)
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not scale > 0:
        return f"the config's logit scale {scale!r} (kl_kernels takes a scale > 0)"
    if (softcap is not None or scale != 1.0) and not _op_takes_transform():
        what = f"final_logit_softcapping={softcap!r}" if softcap is not None else f"the config's logit scale {scale!r}"
        return f"{what} (this kl_kernels' linear_token_logprobs has no softcap=/logit_scale= yet)"
    if softcap is not None and (not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not softcap > 0):
        return f"final_logit_softcapping={softcap!r} (kl_kernels takes a cap > 0)"
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover - transformers without its DeepSpeed module
        return None
    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 (a partitioned LM head, gathered by TRL's head around each use)"
    return None


class LMHeadFallbackWarning(UserWarning):
    """A model keeps TRL's own fused LM head for an option kl_kernels' head does not compute (the message names
    it); its log-probs and entropy are TRL's."""


def _warn(model, reason: str) -> None:
    warnings.warn(f"kl_kernels LM head: {type(model).__name__} keeps TRL's fused LM head because of {reason}; "
                  "its log-probs and entropy are TRL's", LMHeadFallbackWarning, stacklevel=3)


def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple[str, ...] = ("log_probs",)) -> bool:
    """``trl.trainer.utils.add_fused_lm_head`` (TRL 1.16, the same arguments), with
    :func:`kl_kernels.linear_token_logprobs` computing the head.

    ``model(..., labels=labels, fused_lm_head=True)`` (or ``shift_labels=``, pre-shifted) returns TRL's
    ``FusedCausalLMOutput``: ``log_probs`` and (with ``"entropy"`` in ``outputs``) ``entropy`` of shape
    ``[B, T - 1]`` (``[B, T]`` with ``shift_labels``), float32, 0 where the label is ``-100``; ``label_mask``;
    ``loss = -log_probs.sum() / max(1, label_mask.sum())`` (or ``/ num_items_in_batch``); the other fields
    None. Without ``fused_lm_head`` the model's forward is the one it had (generation unchanged).

    TRL's head is added first (the fallback): where the module docstring's list sends a model to it,
    this warns once, naming the option, and returns False; else True. Like TRL's, add it to the
    transformers model, before PEFT wraps it (for a ``PeftModel``: ``model.get_base_model()``).

    Example (``model``: a transformers causal LM)::

        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
        out = model(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100), fused_lm_head=True)
        out.log_probs.shape   # [B, T - 1]
    """
    from trl.trainer import utils as trl_utils

    settings = (float(temperature), bool(cast_lm_head_to_fp32), tuple(outputs))
    if getattr(model, "_kl_kernels_lm_head", None) == settings:  # already ours, the same head: nothing to do
        return True
    trl_utils.add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                                outputs=outputs)
    reason = unfused_reason(model, outputs)
    if reason is not None:
        _warn(model, reason)
        return False
    trl_forward = model.forward  # TRL's head: its non-fused path is the model's forward as it was
    scale, softcap = config_logit_transform(model.config)
    transform = {"logit_scale": float(scale), "softcap": None if softcap is None else float(softcap)}
    if softcap is None and scale == 1.0:
        transform = {}  # (the op's arguments are passed only when they do something)
    want_entropy = "entropy" in outputs
    text_config = model.config.get_text_config()
    backbone_attr = "base_model"
    import transformers
    from packaging.version import Version

    if text_config is not model.config and Version(transformers.__version__) < Version("5.0.0"):
        backbone_attr = "model"  # (TRL's rule: older vision-language models expose their backbone as `model`)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without distributed tensors: no FSDP2 head either
        DTensor = ()  # noqa: N806
    warned = []

    @functools.wraps(type(model).forward)
    def _kl_kernels_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                            num_items_in_batch=None, **kwargs):
        trls = not fused_lm_head  # (TRL's non-fused path: the model's own forward)
        if not trls and isinstance(self.get_output_embeddings().weight, DTensor):  # FSDP2: TRL's head gathers it
            if not warned:
                warned.append(True)
                _warn(self, "an FSDP2 (DTensor) LM head")
            trls = True
        if trls:
            return trl_forward(*args, fused_lm_head=bool(fused_lm_head), labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden = getattr(self, backbone_attr)(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        lm_head = self.get_output_embeddings()
        hidden = hidden.to(lm_head.weight.device)
        labels = labels.to(lm_head.weight.device)
        per_token = head_log_probs(hidden, lm_head.weight, lm_head.bias, labels, temperature=temperature,
                                   cast_lm_head_to_fp32=cast_lm_head_to_fp32, return_entropy=want_entropy,
                                   **transform)
        log_probs, entropy, mask = per_token
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return trl_utils.FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)

    model.forward = types.MethodType(_kl_kernels_forward, model)
    model._kl_kernels_lm_head = settings  # (temperature, cast_lm_head_to_fp32, outputs): truthy
    return True


def head_log_probs(hidden, weight, bias, labels, *, temperature=1.0, cast_lm_head_to_fp32=False,
                   return_entropy=True, logit_scale=None, softcap=None):
    """The head's part of TRL's fused forward with ``linear_token_logprobs``: ``hidden [B, T, H]``, the head
    ``weight [V, H]``/``bias [V]``, ``labels [B, T]`` (``-100``: not scored) -> ``(log_probs, entropy, mask)``,
    ``[B, T]`` float32 (entropy None without ``return_entropy``), zeros where ``mask`` (``labels != -100``) is
    False; computed in the autocast dtype when autocast is on, else in ``hidden``'s dtype, or in float32 with
    autocast off with ``cast_lm_head_to_fp32``, as TRL's head. Only the scored rows reach the op."""
    from ..token_logprobs.linear import linear_token_logprobs

    mask = labels != -100
    device = hidden.device
    if cast_lm_head_to_fp32:
        dtype = torch.float32
    else:
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
    transform = {} if logit_scale is None and softcap is None else {
        "logit_scale": 1.0 if logit_scale is None else logit_scale, "softcap": softcap}
    with torch.autocast(device.type, enabled=False):  # (the inputs cast to the computing dtype above)
        rows = hidden[mask].to(dtype)
        out = linear_token_logprobs(rows, weight.to(dtype), labels[mask], bias=None if bias is None else bias.to(dtype),
                                    temperature=temperature, return_entropy=return_entropy, **transform)
    # masked_scatter keeps an all-masked micro-batch connected to the model (a zero with a gradient), as TRL's
    log_probs = out.log_probs.float().new_zeros(mask.shape).masked_scatter(mask, out.log_probs.float())
    entropy = None
    if return_entropy:
        entropy = out.entropy.float().new_zeros(mask.shape).masked_scatter(mask, out.entropy.float())
    return log_probs, entropy, mask


def patch_lm_head(trainer) -> bool:
    """Put :func:`add_fused_lm_head` on a constructed TRL ``GRPOTrainer`` (or a subclass): its policy (the base
    model under PEFT, with ``("log_probs", "entropy")`` as TRL asks) and its reference model (when it has one;
    under PEFT TRL computes the reference with the adapters off, through the same patched model), with the
    trainer's ``temperature`` and ``args.cast_lm_head_to_fp32``. Returns True when ours computes both heads,
    False when one kept TRL's (it warned, naming why)."""
    model = trainer.model
    base = model.get_base_model() if _is_peft(model) else model
    cast = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    with warnings.catch_warnings(record=True) as caught:  # (the two models' same reason: one warning)
        warnings.simplefilter("always", LMHeadFallbackWarning)
        ok = add_fused_lm_head(base, temperature=trainer.temperature, cast_lm_head_to_fp32=cast,
                               outputs=("log_probs", "entropy"))
        if getattr(trainer, "ref_model", None) is not None:
            ok = add_fused_lm_head(trainer.ref_model, temperature=trainer.temperature,
                                   cast_lm_head_to_fp32=cast) and ok
    for message in dict.fromkeys(str(w.message) for w in caught if w.category is LMHeadFallbackWarning):
        warnings.warn(message, LMHeadFallbackWarning, stacklevel=2)
    for w in caught:  # anything else, as it came
        if w.category is not LMHeadFallbackWarning:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return ok


def _is_peft(model) -> bool:
    from accelerate.utils import is_peft_model  # (TRL's own test)

    return is_peft_model(model)


__all__ = ["LMHeadFallbackWarning", "add_fused_lm_head", "config_logit_transform", "head_log_probs", "patch_lm_head",
           "unfused_reason"]
