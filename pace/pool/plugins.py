"""Pool policies from outside the package: `pool.name=my_package.module:MyPolicy`.

A policy is a class with the methods of `PoolPolicy` (subclassing it is the easy way: it supplies
every method but `select`'s decision). What the pool calls, and when:

    __init__(batch_prompts, max_inflight_groups, **pool.args)   once, at start
    admits(view: AdmissionView) -> bool      may the rollout start another group? (rollout thread)
    select(pooled: PoolColumns, step) -> Selection | None
                                             batch j, and the groups removed with a fate and a
                                             reason; None waits for more groups (trainer thread)
    state_dict() -> dict, load_state_dict(dict)   the policy's own state, in every checkpoint
    pfs_candidates(pooled, step) -> slots    optional: pooled groups to rescore for their Prefix
                                             Forgetting Score (`pooled.pfs`); rescoring runs only
                                             for policies that define it

`Selection.metrics` is logged every step as `pool/<key>`. Removed groups take a fate of
`pace.records.Fate` (REJECTED or DROPPED_STALE); the reason string is logged per group. Both run
under the pool lock: keep them vectorised over `pooled`'s columns (`pace/pool/columns.py`).
"""
from __future__ import annotations

import importlib
import inspect

from pace.errors import ConfigError
from pace.pool.base import PoolPolicy

REQUIRED = ("admits", "select", "state_dict", "load_state_dict")


class PolicyError(ConfigError):
    """A policy given by import path cannot be used; the message is one line naming the path."""


def is_import_path(name: str) -> bool:
    return ":" in name


def load(path: str) -> type:
    """The class at ``module:Class``, checked against the protocol."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise PolicyError(f"pool.name={path}: an import path is module.path:ClassName")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an import runs the user's code: any error is theirs
        raise PolicyError(f"pool.name={path}: cannot import {module_name} ({type(exc).__name__}: {exc}); "
                          "is its directory on PYTHONPATH?") from exc
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls):
        raise PolicyError(f"pool.name={path}: {module_name} has no class {attr}")
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        raise PolicyError(f"pool.name={path}: {attr} lacks {', '.join(m + '()' for m in missing)} "
                          f"(a pool policy needs {', '.join(REQUIRED)}; subclass pace.pool.PoolPolicy)")
    return cls


def args_of(cfg) -> dict:
    """`pool.args` as plain Python values (nested mappings and lists included)."""
    args = getattr(cfg.pool, "args", None)
    if args is None:
        return {}
    from omegaconf import OmegaConf

    return OmegaConf.to_container(args, resolve=True) if OmegaConf.is_config(args) else dict(args)


def check(path: str, args: dict) -> type:
    """Importable, the protocol's methods, and a constructor that takes `pool.args`: raises
    PolicyError in one line. Nothing is constructed."""
    cls = load(path)
    try:
        inspect.signature(cls).bind(batch_prompts=1, max_inflight_groups=1, **args)
    except TypeError as exc:
        raise PolicyError(f"pool.args={args} do not fit {cls.__name__}{inspect.signature(cls)}: {exc}") from exc
    return cls


def build(path: str, batch_prompts: int, max_inflight_groups: int, args: dict) -> PoolPolicy:
    cls = check(path, args)
    try:
        policy = cls(batch_prompts=batch_prompts, max_inflight_groups=max_inflight_groups, **args)
    except Exception as exc:  # noqa: BLE001 - the user's constructor: say where it failed, in one line
        raise PolicyError(f"pool.name={path}: {cls.__name__}(pool.args={args}) raised {type(exc).__name__}: {exc}") from exc
    if getattr(policy, "batch_prompts", None) != batch_prompts:
        raise PolicyError(f"pool.name={path}: {cls.__name__} must keep batch_prompts={batch_prompts} as "
                          "self.batch_prompts (the pool reads it)")
    return policy


def reads_pfs(policy) -> bool:
    """Does the policy ask for Prefix Forgetting Scores (PACE ranks by them; `RecordingPolicy` records
    them), so the rollout rescores for it?"""
    return getattr(type(policy), "pfs_candidates", PoolPolicy.pfs_candidates) is not PoolPolicy.pfs_candidates
