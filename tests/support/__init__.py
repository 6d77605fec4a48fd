"""Helpers shared by the test folders (and some benchmarks): plain functions and classes, imported as
``tests.support.<module>``; fixtures built on them live in the conftest files.

- ``arctic``: verl configs and verl-shaped GRPO batches for the Arctic adapter, HF reference log-probs, Ray.
- ``e2e``: a tiny GRPO task, the recipe's overrides, one run through ``verl.remote_backend.main_ppo``
  (``run_recipe``: its log kept, its metrics read back) and what every run logs (``check_steps``).
- ``model_shapes``: the attention shapes of the recipes' real models (``config.json`` keys), without weights.
- ``reliability``: a TCP proxy that drops answers or requests, a server supervisor, client configs and batches.
- ``rollout``: dispatching GRPO samples through the rollout path and checking them.
- ``scripts``: loading an example or benchmark script as a module.
- ``server``: the reference server as a subprocess (``running_server``), request bodies for it, and a check
  of a server flag with its environment variable (``check_server_flag``).
- ``tinker``: the Tinker peer (SkyRL's Tinker server on CPU) and the Tinker GRPO recipe (``run_tinker_grpo``,
  ``check_tinker_grpo``).
- ``vendor``: where the vendor's Arctic-Platform code is found, and its v2 and v1 servers.
- ``vllm_stand_in``: objects shaped like vLLM's outputs, and the sampling engine around a stand-in ``LLM``.
- ``zorro``: tiny models and batches for the ZoRRO pass tests.
"""
