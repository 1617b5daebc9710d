"""The names of the policies whose modules need numpy or scipy (decode admission, length predictors), so
that what only names them — `PolicySet`'s validation, the CLI's help — loads neither."""

from __future__ import annotations

ADMISSION_POLICIES = ("greedy", "reserve-static", "reserve-dynamic", "plan")
RESERVE_POINTS = ("lower", "mid", "upper")
PREDICTORS = ("none", "oracle", "learned")
QUEUE_ORDERS = ("fcfs", "srpt")  # the order decode and colocated instances admit waiting requests in
# what a colocated instance (reject: a prefill instance too) does with a request past ttft_target_s
TTFT_MISSES = ("last", "reject")
