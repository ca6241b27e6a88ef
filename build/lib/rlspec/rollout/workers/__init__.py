"""Rollout workers on Ray: N RolloutEngine replicas behind the RolloutBackend protocol.

`pool.RayPool` is the backend ("ray" in rollout/backend.py's registry); `worker.RolloutWorker` is
the actor around one engine; `tasks` splits a call into prompt-group tasks with their seeds and
merges the results; `dispatch` runs the queue (fast workers take more, a dead worker's tasks go to
the survivors, bounded retries); `cluster` joins or starts Ray (a local one on 127.0.0.1 only) and
watches its head; what the pool raises lives in rollout/errors.py (RolloutBackendLost: the pool is gone,
resume from a checkpoint); `spot` is TLT's drafter trainer fed by every worker; `stats` merges the workers'
metrics. Only pool.py, dispatch.py and cluster.py import Ray, and rollout/backend.py imports the pool only
when a "ray" backend is built, so the rest of rlspec runs without Ray installed (docs/workers.md).
"""
