"""The server's per-token numbers: log-probs and entropy of a batch, the losses, rollout correction.

==========================  =====================================================================
module                      what it is
==========================  =====================================================================
:mod:`.token_logprobs`      response-aligned per-token log-probs and entropy, plain or with ZoRRO
:mod:`.chunked_head`        the LM head run chunk by chunk on hidden states (no whole logits)
:mod:`.losses`              the policy losses (GRPO/PPO clip, ...) and their metrics
:mod:`.rollout_correction`  importance weights and rejection masks for off-policy rollouts
==========================  =====================================================================
"""
