"""The prefill replicas' streaming scheduler: policy.py (who goes first), core.py (plan, evict, swap in,
invalidate: the vLLM scheduler subclass), swap.py (host pool), cost_model.py and profile.py (recompute vs
swap latency), config.py (settings)."""
