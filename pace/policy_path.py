"""A pool policy named by import path (`pool.name=my_package.module:MyPolicy`), checked as config:
importable, the policy protocol's methods, a constructor that takes `pool.args`. Nothing is
constructed and nothing of `pace.pool` is imported, so `pace.config_checks.validate` can check it at start
(the protocol and the building: pace/pool/plugins.py).
"""
from __future__ import annotations

import importlib
import inspect

from pace.errors import ConfigError

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
