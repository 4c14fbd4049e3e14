"""Pool policies by import path (`pool.name=module:Class`): loading and its one-line errors, the
example policy's decisions against hand-computed lags, its state through a pool checkpoint, and the
simulator driving it. (tests/integration/test_train_e2e.py runs it through train.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from examples.pool_policies.freshest import FreshestPolicy
from pace.config import Config
from pace.config_checks import validate
from pace.errors import ConfigError
from pace.pool import Pool, PoolPolicy, Selection, build_policy
from pace.pool.plugins import reads_pfs
from pace.pool.policies import AsyncPolicy, PacePolicy
from pace.records import Fate, Group, Trajectory

pytestmark = pytest.mark.unit
EXAMPLE = "examples.pool_policies.freshest:FreshestPolicy"
HERE = "tests.unit.test_pool_plugins"


class NoSelect:  # a policy missing two methods of the protocol
    def __init__(self, batch_prompts, max_inflight_groups):
        self.batch_prompts = batch_prompts

    def admits(self, view):
        return True

    def state_dict(self):
        return {}


class Fussy(PoolPolicy):
    def __init__(self, batch_prompts, max_inflight_groups, width: int = 1):
        super().__init__(batch_prompts, max_inflight_groups)
        if width < 1:
            raise ValueError("width must be >= 1")


class Nested(PoolPolicy):
    def __init__(self, batch_prompts, max_inflight_groups, table: dict | None = None, order: list | None = None):
        super().__init__(batch_prompts, max_inflight_groups)
        self.table, self.order = table, order


class ReadsPfs(PoolPolicy):
    def pfs_candidates(self, pooled, step):
        return pooled.slots()


def cfg_of(*overrides: str):
    """The schema's defaults with ``key=value`` overrides (values as YAML, pool.name as a string)."""
    cfg = OmegaConf.structured(Config)
    for item in overrides:
        key, _, value = item.partition("=")
        OmegaConf.update(cfg, key, value if key == "pool.name" else yaml.safe_load(value), force_add=True)
    return cfg


@pytest.mark.parametrize("overrides, message", [
    ([f"pool.name={HERE}:NoSelect"], f"pool.name={HERE}:NoSelect: NoSelect lacks select(), load_state_dict() "
                                     "(a pool policy needs admits, select, state_dict, load_state_dict; "
                                     "subclass pace.pool.PoolPolicy)"),
    (["pool.name=my_lab.policies:Mine"], "pool.name=my_lab.policies:Mine: cannot import my_lab.policies "
                                         "(ModuleNotFoundError: No module named 'my_lab'); is its directory on PYTHONPATH?"),
    ([f"pool.name={HERE}:Missing"], f"pool.name={HERE}:Missing: {HERE} has no class Missing"),
    ([f"pool.name={HERE}:cfg_of"], f"pool.name={HERE}:cfg_of: {HERE} has no class cfg_of"),
    (["pool.name=examples.pool_policies.freshest:"], "an import path is module.path:ClassName"),
    ([f"pool.name={HERE}:Fussy", "pool.args.size=2"], "pool.args={'size': 2} do not fit Fussy(batch_prompts, "
                                                      "max_inflight_groups, width: 'int' = 1): got an unexpected keyword argument 'size'"),
    (["pool.name=pace", "pool.args.keep=2"], "pool.args={'keep': 2} is for a policy given by import path"),
])
def test_a_policy_that_cannot_be_used_fails_validation_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(cfg_of(*overrides))
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_a_constructor_that_raises_fails_in_one_line_when_the_pool_is_built():
    cfg = cfg_of(f"pool.name={HERE}:Fussy", "pool.args.width=0")
    validate(cfg)  # validation imports and checks the signature; it constructs nothing
    with pytest.raises(ConfigError, match=r"^pool.name=tests.unit.test_pool_plugins:Fussy: Fussy\(pool.args=\{'width': 0\}\) "
                                          r"raised ValueError: width must be >= 1$"):
        build_policy(cfg)


def test_a_policy_by_import_path_is_built_with_its_args():
    cfg = cfg_of(f"pool.name={EXAMPLE}", "pool.args.keep=3", "data.batch_prompts=4")
    validate(cfg)
    policy = build_policy(cfg)
    assert type(policy) is FreshestPolicy and policy.cap == 12 and policy.batch_prompts == 4


def test_nested_args_reach_the_policy_as_plain_python():
    cfg = cfg_of(f"pool.name={HERE}:Nested", "pool.args.table={a: [1, 2]}", "pool.args.order=[3, 1]")
    validate(cfg)
    policy = build_policy(cfg)
    assert type(policy.table) is dict and type(policy.table["a"]) is list and policy.order == [3, 1]


def test_the_rollout_rescores_only_for_policies_that_read_the_pfs():
    assert reads_pfs(PacePolicy(4, 8, "effective", 1.0, 4, 0.9, 16))
    assert not reads_pfs(AsyncPolicy(4, 8))
    assert reads_pfs(ReadsPfs(4, 8)) and not reads_pfs(Fussy(4, 8)) and not reads_pfs(NoSelect(4, 8))


def _group(gid: int, versions: list[int], completed: int) -> Group:
    """One trajectory whose tokens carry ``versions``, completed at ``completed``; mixed rewards."""
    trajs = [Trajectory(response_ids=[5] * len(versions), logprobs=[-0.5] * len(versions), versions=versions,
                        completed_at=completed, finish_reason="stop", correct=r > 0, reward=r) for r in (1.0, -1.0)]
    return Group(id=gid, prompt_id=f"p{gid}", prompt_ids=[1], answer="1", submitted_at=versions[0], trajectories=trajs)


def test_the_example_takes_the_freshest_and_drops_the_oldest_beyond_its_cap():
    # B = 2, keep = 2: cap 4. Six groups in completion order; at step 5 each one's lag K = K_gen + K_wait
    # (every token of a group at one version v, completed at c: K_gen = c − v, K_wait = 5 − c, K = 5 − v):
    #   id:      0  1  2  3  4  5
    #   version: 1  4  0  3  2  4       → K: 4 1 5 2 3 1
    # freshest two: ids 1 and 5 (K = 1; id 1 completed first); kept in the pool: 3, 4 (next two);
    # dropped beyond the cap: 0 and 2 (K = 4, 5).
    policy = FreshestPolicy(batch_prompts=2, max_inflight_groups=16, keep=2)
    pool = Pool(policy, informative=lambda g: True)
    versions, completed = [1, 4, 0, 3, 2, 4], [1, 4, 2, 3, 4, 5]
    for gid, (v, c) in enumerate(zip(versions, completed)):
        g = _group(gid, [v, v], c)
        pool.on_submitted(g)
        pool.add(g, c)
    batch = pool.form_batch(5, timeout=0)
    assert [g.id for g in batch.groups] == [1, 5]
    decided = {g.id: (g.fate, g.reason) for g in pool.drain_decided()}
    assert decided[0] == decided[2] == (Fate.DROPPED_STALE, "freshest: beyond 4")
    assert sorted(g.id for g in pool.remaining()) == [3, 4]
    assert pool.last_metrics == {"dropped": 2, "dropped_total": 2}
    pool.check_accounting()
    # its state goes through the pool's checkpoint
    state = pool.state_dict()
    resumed = Pool(FreshestPolicy(batch_prompts=2, max_inflight_groups=16, keep=2), informative=lambda g: True)
    resumed.load_state_dict(state)
    assert resumed.policy.dropped == 2 and resumed.counts() == pool.counts()


def test_the_simulator_runs_a_policy_by_import_path():
    from pace.sim.config import SimRunConfig, validate_sim
    from pace.sim.run import Simulation

    cfg = OmegaConf.merge(OmegaConf.structured(SimRunConfig), OmegaConf.from_dotlist([
        f"pool.name={EXAMPLE}", "pool.args.keep=1.5", "data.batch_prompts=8", "data.group_size=8",
        "rollout.max_inflight_groups=32", "rollout.engines=2", "rollout.max_tokens=96", "trainer.steps=20",
        "sim.engine.step_s=0.01", "sim.trainer.step_s=1.0", "sim.trainer.sync_s=0.1",
        "sim.responses.levels=[{p_correct: 0.6, concentration: 2, len_median: 30, len_sigma: 0.8}]"]))
    validate_sim(cfg)
    sim = Simulation(cfg)
    sim.run()
    c = sim.pool.counts()
    assert type(sim.pool.policy) is FreshestPolicy and c["consumed"] == 20 * 8
    assert c["dropped_stale"] == sim.pool.policy.dropped > 0
    assert sum(v for k, v in c.items() if k != "submitted") == c["submitted"]
    assert all("pool/dropped" in r for r in sim.rows)
    assert np.all(np.diff([r["pool/dropped_total"] for r in sim.rows]) >= 0)


class Careless(PoolPolicy):
    """Returns a decision the pool must refuse: ``mistake`` picks which."""

    def __init__(self, batch_prompts, max_inflight_groups, mistake: str = "twice"):
        super().__init__(batch_prompts, max_inflight_groups)
        self.mistake = mistake

    def select(self, pooled, step):
        first = pooled.first(self.batch_prompts)
        if self.mistake == "twice":
            return Selection(batch=first, removed=[(first[0], Fate.REJECTED, "")])
        fate = Fate.CONSUMED if self.mistake == "fate" else "rejected"  # a fate, or a plain string
        return Selection(batch=first[1:], removed=[(first[0], fate, "")])


@pytest.mark.parametrize("mistake, message", [
    ("twice", "Careless.select returned a group twice, or one that is not pooled"),
    ("fate", "Careless.select returned fate <Fate.CONSUMED: 'consumed'> (a policy removes groups as Fate.REJECTED "
             "or Fate.DROPPED_STALE)"),
    ("str", "Careless.select returned fate 'rejected' (a policy removes groups as Fate.REJECTED or Fate.DROPPED_STALE)"),
])
def test_the_pool_refuses_a_decision_outside_the_protocol(mistake, message):
    pool = Pool(Careless(2, 8, mistake), informative=lambda g: True)
    for gid in range(3):
        g = _group(gid, [0], 0)
        pool.on_submitted(g)
        pool.add(g, 0)
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pool.form_batch(0, timeout=0)
    assert pool.counts()["pooled"] == 3  # nothing applied
