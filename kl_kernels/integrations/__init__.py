"""Drop-in shims for RL libraries: verl, OpenRLHF and TRL.

Each submodule offers functions with the peer's own names, signatures and defaults, computed by
kl_kernels' fused ops, and imports without the peer installed:

* :mod:`kl_kernels.integrations.verl`: ``kl_penalty``, ``agg_loss``, ``compute_policy_loss_vanilla``,
  ``apply_kl_penalty``, the KL controllers, and :func:`~kl_kernels.integrations.verl.register` (verl's
  policy-loss registry);
* :mod:`kl_kernels.integrations.openrlhf`: ``compute_approx_kl``, ``compute_reward``, ``masked_mean``,
  the KL controllers, ``PolicyLoss``;
* :mod:`kl_kernels.integrations.trl`: ``GRPOTrainer`` (TRL's, with the fused loss: one import) and ``patch``
  (a built trainer), and ``grpo_loss``, the GRPO loss of TRL's ``GRPOTrainer._compute_loss``.

What each matches, and where it deviates, is in ``python_api/integrations.md``; the tests in
``tests/test_integrations_*.py`` compare every shim with the peer's own function.
"""
