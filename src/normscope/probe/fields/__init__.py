"""Inference, one module per contract field: each step is a function of the target's :class:`~.probe.Probe` and
of the earlier steps' results, returning its field value(s) with their :class:`~normscope.results.inference.Evidence`.

- :mod:`.probe`: the target, probe shape and dtype, the random stream; ``rel``, ``natural``, ``channel_affine``;
- :mod:`.target`: determinism (the noise floor) and inputs modified in place — findings about the target;
- :mod:`.modes`: ``batch_stats`` (train/eval behaviour);
- :mod:`.axes`: ``axes``, ``groups``, ``group_axis`` (the dependency experiment, scale invariance);
- :mod:`.center`: ``center`` (common shift);
- :mod:`.affine`: ``gamma``, ``beta``, ``param_axes``, ``gamma_offset`` (±u, u normalized);
- :mod:`.variance`: ``variance`` (÷d or ÷(d−1), from the affine experiment's gain);
- :mod:`.eps`: ``eps``, ``eps_placement`` (the ε placement experiment: gain of u·√v);
- :mod:`.variance_algorithm`: ``variance_algorithm`` (one-pass or two-pass, at a large offset);
- :mod:`.low_precision`: ``stats_dtype``, ``affine_order`` (bf16/fp16 outputs, through
  :mod:`normscope.probe.precision_experiment`);
- :mod:`.running`: running mean and variance of a module in evaluation mode;
- :mod:`.frozen`: every field of a BatchNorm frozen in both modes, from its buffers;
- :mod:`.validation`: the inferred contract against the target on fresh inputs.

:func:`normscope.probe.infer.infer` runs them in order.
"""
