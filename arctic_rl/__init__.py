"""arctic_rl: this project's own implementation of the Arctic RL wire protocol.

This is *not* Snowflake's ``arctic_platform`` package. It holds what both sides of the
protocol share -- endpoint paths, request/response models and ``JobConfig``
(:mod:`arctic_rl.protocol`), the DSSST1 tensor codec (:mod:`arctic_rl.dssst1`) -- and a
self-hostable reference server (:mod:`arctic_rl.server`).

It never imports ``verl`` (``import verl`` pulls in ray), so it deploys on a GPU box that has
only torch, transformers and deepspeed.
"""

__version__ = "0.1.0"
