"""The completed-group pool and its policies (docs/design.md §3).

`Pool` is the one thread-safe container and the fate accounting; a `PoolPolicy` decides admission
(may the rollout start another group?) and selection (which pooled groups form batch j, which are
rejected). Policies are small classes registered by name; `build_policy(cfg)` picks one.
"""
from pace.pool.base import AdmissionView, Pool, PoolPolicy, Selection
from pace.pool.policies import POLICIES, build_policy

__all__ = ["AdmissionView", "Pool", "PoolPolicy", "Selection", "POLICIES", "build_policy"]
