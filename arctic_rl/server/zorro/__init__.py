"""ZoRRO (Zero Redundancy Rollouts): each unique prompt through the model once, its responses after it.

=====================  ==========================================================================
module                 what it is
=====================  ==========================================================================
:mod:`.forward`        the two-pass forward (prompts once, then responses), prompt grouping
:mod:`.attention`      the attention wrapper that routes each layer through the running pass
:mod:`.flex`           the grouped response pass with FlexAttention (no prompt copies)
:mod:`.passes`         how a call's rows are grouped into passes under a token bound
:mod:`.rule`           the token rule: when ZoRRO's pass computes few enough tokens to pay
:mod:`.tuner`          which pass is faster for one job, timed on the job's own calls
:mod:`.planner`        the one pass choice (group, rule, tuner, timing) the engines ask
=====================  ==========================================================================
"""
