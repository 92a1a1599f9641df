"""The prefill replicas' streaming scheduler, run inside the prefill vLLM engine.

- `core.py`: the vLLM scheduler subclass: rank, plan, evict, swap in (the two phases), bookkeeping;
- `policy.py`: who is prefilled first and who is evicted first (fcfs, lcas, mcps, vllm);
- `swap.py`: the bounded host pool (slots in the scheduler, copies in the workers);
- `invalidate.py`: cutting a request's KV back to the common prefix of rewritten input;
- `cost_model.py`, `profile.py`: recompute vs swap latency models, and the command that profiles them;
- `engine_calls.py`: the frontend's utility calls into the engine core;
- `config.py`: the settings (`prefill.scheduler` in the app config).
"""
