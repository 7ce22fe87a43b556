"""kl_kernels: fused KL-penalty kernels for RL from feedback on language models.

Public API:

* :func:`kl_reward`: per-token KL estimate and KL-penalized reward on ragged, assistant-masked
  batches (packed, padded, nested or list layouts), forward and backward.
* :mod:`kl_kernels.ragged`: the canonical ragged-batch form (values + int64 offsets) and its
  converters.
* :func:`kl_penalty_loss`: PPO policy loss with a KL penalty (KL to the old policy or to a
  reference), PPO clipping, entropy bonus and every aggregation, forward and backward fused.
* :class:`FixedKLController`, :class:`AdaptiveKLController`, :class:`ZieglerKLController`: the KL
  coefficient (beta) of a KL penalty, fixed or adapted to a target KL, with state on device.
* :func:`token_logprobs`: per-token log-probs (and entropy) from logits, chunked: no ``[N, V]``
  float32 temporary, forward or backward; :func:`linear_token_logprobs` the same from hidden
  states and the LM head, without the ``[N, V]`` logits at all.
* :func:`full_kl`: the exact KL to the reference over the whole vocabulary per token, from both
  models' logits, chunked, with gradients to both; :func:`linear_full_kl` the same from both models'
  hidden states and LM heads, without either's ``[N, V]`` logits.
* :mod:`kl_kernels.torchrl` (``torchrl`` extra): TorchRL drop-in KL transforms.
* :func:`check_errors`: raise a bad value (offsets, lengths, prompt_lens, labels) that a kernel found on
  an accelerator, after waiting for the queued work; without it such an error surfaces at the next call
  of ours on that device (:mod:`kl_kernels.device_errors`: no host sync, the CUDA context survives).
* :func:`info`: which backends (torch, cpu, cuda, triton) can run here, and why not.

Importing never fails because a compiled extension is missing or cannot load; that is reported
by :func:`info` and by the dispatcher.
"""

from . import ragged
from ._info import info
from .value_checks import check_errors
from .backends import BackendUnavailableError
from .full_kl import full_kl, linear_full_kl
from .kl_penalty import (AGGREGATIONS, AdaptiveKLController, FixedKLController, KLPenaltyLossOutput,
                         ZieglerKLController, kl_penalty_loss)
from .linear_loss import linear_kl_penalty_loss
from .kl_reward import ESTIMATORS, PLACEMENTS, KLRewardOutput, kl_reward
from .token_logprobs import (LinearTokenLogprobsOutput, TokenLogprobsOutput, linear_token_logprobs,
                             token_logprobs)
from .version import __version__

__all__ = ["kl_reward", "KLRewardOutput", "ESTIMATORS", "PLACEMENTS", "ragged", "info",
           "BackendUnavailableError", "FixedKLController", "AdaptiveKLController", "ZieglerKLController",
           "kl_penalty_loss", "KLPenaltyLossOutput", "AGGREGATIONS", "token_logprobs", "linear_token_logprobs", "TokenLogprobsOutput",
           "LinearTokenLogprobsOutput", "full_kl", "linear_full_kl", "linear_kl_penalty_loss", "check_errors",
           "__version__"]
