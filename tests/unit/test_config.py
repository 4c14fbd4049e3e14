"""Tests for the typed config (pace.config) and every experiment preset in conf/exp/.

Composition uses Hydra's compose API on the real conf/ directory; presets are discovered by glob,
so a new `conf/exp/<name>.yaml` is covered without editing this file. Files whose name starts with
`_` are shared bases, not runnable presets. Nothing here touches a device: the Qwen3-8B presets
must compose on a CPU-only machine.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from pace.config import register
from pace.config_checks import validate
from pace.errors import ConfigError
from tests.helpers import CONF, PAPER_PRESETS, PRESETS, compose_cfg

pytestmark = pytest.mark.unit


register()


def test_presets_were_found() -> None:
    # Guards the glob: if conf/ moves, the parametrised test below would silently cover nothing.
    assert {"sync_tiny", "async_tiny", "sync_qwen3_8b", "async_qwen3_8b"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates(preset: str) -> None:
    cfg = compose_cfg([f"+exp={preset}"])
    validate(cfg)
    assert cfg.exp_name == preset  # runs are named after their preset


def test_default_is_the_tiny_async_run() -> None:
    cfg = compose_cfg()
    validate(cfg)
    assert cfg.model.path is None  # embedded tiny model
    assert cfg.pool.name == "async"
    assert cfg.data.source == "arithmetic"
    assert cfg.algo.name == "dapo"
    assert cfg.exp_name == "default"


def test_qwen3_8b_presets_carry_the_paper_values() -> None:
    sync, asyn = compose_cfg(["+exp=sync_qwen3_8b"]), compose_cfg(["+exp=async_qwen3_8b"])
    for cfg in (sync, asyn):
        assert cfg.model.path == "Qwen/Qwen3-8B-Base"  # the Base model, as the DAPO recipe's Qwen3 runs
        assert cfg.data.source == "math" and cfg.data.path
        assert cfg.data.group_size == 16  # DAPO recipe: G = 16
        assert (cfg.algo.eps_low, cfg.algo.eps_high) == (0.2, 0.28)  # DAPO recipe: clip-higher
        assert cfg.trainer.steps == 300  # paper: the first 300 training steps
        assert cfg.device == "cuda"
    assert (sync.pool.name, asyn.pool.name) == ("sync", "async")
    # The two baselines are the same run except for the pool policy (and the run name).
    a, b = (OmegaConf.to_container(c, resolve=True) for c in (sync, asyn))
    for d in (a, b):
        d.pop("pool"), d.pop("exp_name")
    assert a == b


# ---------------------------------------------------------------- composition errors name the key


def test_unknown_key_fails_at_composition() -> None:
    with pytest.raises(HydraException, match=r"trainer\.foo"):
        compose_cfg(["trainer.foo=1"])


def test_key_added_with_plus_fails_validation() -> None:
    # Hydra's `+key=` appends even to a typed config; validate re-merges onto the schema.
    cfg = compose_cfg(["+trainer.foo=1"])
    with pytest.raises(ConfigError, match=r"trainer\.foo"):
        validate(cfg)


def test_wrong_type_fails_at_composition() -> None:
    with pytest.raises(HydraException) as info:
        compose_cfg(["trainer.steps=abc"])
    text = str(info.value) + str(info.value.__cause__)
    assert "trainer.steps" in text


@pytest.mark.parametrize(
    "body, key",
    [("trainer:\n  stepz: 5\n", "trainer.stepz"), ("trainer:\n  steps: many\n", "trainer.steps")],
)
def test_preset_with_typo_or_wrong_type_fails_naming_the_key(tmp_path: Path, body: str, key: str) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "exp" / "broken.yaml").write_text("# @package _global_\n" + body)
    with pytest.raises(HydraException) as info:
        compose_cfg(["+exp=broken"], config_dir=conf)
    assert key in str(info.value) + str(info.value.__cause__)


# ---------------------------------------------------------------- validate names the key


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["pool.name=foo"], "pool.name"),
        (["data.group_size=1"], "data.group_size"),
        (["rollout.overlong_buffer=96", "rollout.max_tokens=96"], "rollout.overlong_buffer"),
        (["rollout.overlong_buffer=200", "rollout.max_tokens=96"], "rollout.overlong_buffer"),
        (["rollout.overlong_buffer=-1"], "rollout.overlong_buffer"),
        (["pool=sync", "rollout.sync_every=2"], "rollout.sync_every"),
        (["+exp=sync_tiny", "rollout.sync_every=2"], "rollout.sync_every"),
        (["data.source=math"], "data.path"),
        (["trainer.mini_batches=9", "data.batch_prompts=8"], "trainer.mini_batches"),
        (["rollout.max_tokens=256", "rollout.max_model_len=256"], "rollout.max_model_len"),
        (["data.batch_prompts=0"], "data.batch_prompts"),
        (["rollout.top_p=0"], "rollout.top_p"),
        (["rollout.top_p=0.9"], "training rollouts need top_p = 1"),  # π_θ/μ would be biased
        (["eval.every=-1"], "eval.every"),
        (["eval.every=5", "eval.benchmarks=[]"], "eval.benchmarks"),
        (["eval.best_within=-1"], "eval.best_within"),
        (["eval.val_max_problems=0"], "eval.val_max_problems"),
        (["eval.top_p=1.5"], "eval.top_p"),
        (["pool.capacity=16", "data.batch_prompts=32"], "pool.capacity"),
        (["pool=pace", "pool.capacity=40", "pace.target_pool=64"], "pace.target_pool"),
        (["pool=pace", "pace.target_pool=8", "data.batch_prompts=32"], "pace.target_pool"),
        (["data.enable_thinking=false"], "data.enable_thinking"),
        (["rollout.placement=colocate", "rollout.weight_transfer=nccl"], "rollout.weight_transfer=nccl"),
        (["trainer.save_every=-1"], "trainer.save_every"),
        (["trainer.keep_checkpoints=0"], "trainer.keep_checkpoints"),
        (["rollout.max_tool_calls=-1"], "rollout.max_tool_calls"),
        (["tools.sandbox=docker"], "tools.sandbox"),
        (["tools.workers=0"], "tools.workers"),
        (["data.template=chatml"], "data.template"),
        (["data.max_prompt_tokens=0"], "data.max_prompt_tokens"),
        (["reward.max_failed_in_row=-1"], "reward.max_failed_in_row"),
        (["eval.max_tokens=256"], "eval.max_tokens"),
        (["algo.clip_ratio_c=1.0"], "algo.clip_ratio_c"),  # the dual clip must be above 1
        (["algo.clip_ratio_c=0.5"], "algo.clip_ratio_c"),
        (["algo.is_correction=tis"], "algo.is_threshold"),
        (["algo.is_correction=trunc"], "algo.is_correction"),
        (["algo.is_correction=tis", "algo.is_threshold=2", "algo.is_level=geometric"], "algo.is_level"),
        (["algo.is_correction=mis", "algo.is_threshold=2", "algo.is_threshold_lower=3"], "algo.is_threshold_lower"),
        (["algo.is_correction=tis", "algo.is_threshold=2", "algo.is_threshold_lower=0.5"], "algo.is_threshold_lower"),
        (["algo=m2po", "algo.is_correction=tis", "algo.is_threshold=2"], "algo.is_correction"),
        (["algo=m2po", "algo.m2po_variant=clip"], "algo.m2po_variant"),
        (["rollout.control_port=70000"], "rollout.control_port"),
        (["rollout.delta_chunk_mib=0"], "rollout.delta_chunk_mib"),
    ],
)
def test_validate_rejects_and_names_the_key(overrides: list[str], key: str) -> None:
    cfg = compose_cfg(overrides)  # composes: these are value constraints, not type errors
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_validate_accepts_async_with_sync_every_2() -> None:
    validate(compose_cfg(["pool=async", "rollout.sync_every=2"]))


def test_the_corrections_and_m2po_variants_validate() -> None:
    validate(compose_cfg(["algo.is_correction=mis", "algo.is_level=geometric", "algo.is_threshold=1.001"]))
    validate(compose_cfg(["algo.ratio_ref=proximal", "algo.is_correction=tis", "algo.is_threshold=2"]))
    validate(compose_cfg(["algo=m2po", "algo.m2po_variant=adaptive_clip"]))
    validate(compose_cfg(["algo.clip_ratio_c=null"]))
    cfg = compose_cfg(["+exp=tis_qwen3_8b"])
    algo = cfg.algo
    assert (algo.ratio_ref, algo.is_correction, algo.is_level, algo.is_threshold) == ("proximal", "tis", "token", 2.0)
    assert compose_cfg(["+exp=m2po_qwen3_8b"]).algo.m2po_variant == "paper"
    assert compose_cfg(["+exp=pace_qwen3_8b"]).algo.std_unbiased is True


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_paper_presets_were_found() -> None:
    assert len(PAPER_PRESETS) >= 20 and {"pace_qwen3_8b", "pace_qwen3_30b_a3b", "pace_qwen3_4b_retool"} <= set(PAPER_PRESETS)


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_paper_presets_take_one_update_per_version_and_dapo512_its_16(preset: str) -> None:
    """The paper's step j uses π_θj and produces θ_{j+1}: one optimizer update per version, on a
    batch of 32 prompts × 16 (a DAPO mini-batch). DAPO's own step (512 prompts, 16 updates per
    version) only in the presets named for it."""
    cfg = compose_cfg([f"+exp={preset}"])
    want = (512, 16) if preset.endswith("_dapo512") else (32, 1)
    assert (cfg.data.batch_prompts, cfg.trainer.mini_batches) == want
    assert cfg.rollout.sync_every == 1 and cfg.data.group_size == 16 and cfg.trainer.steps == 300
    assert cfg.pool.capacity == 16 * cfg.data.batch_prompts  # 16 batches of pooled + in-flight groups
    # the in-flight cap: whole batches, more groups than fill every engine's slots
    fill = cfg.rollout.engines * cfg.rollout.max_num_seqs / cfg.data.group_size
    assert cfg.rollout.max_inflight_groups % cfg.data.batch_prompts == 0 and cfg.rollout.max_inflight_groups > fill


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_paper_presets_start_up_to_the_missing_gpu(preset: str) -> None:
    """What `python train.py +exp=<preset>` does on this CPU machine: validation passes and the run
    stops at the device check, in one line (test_train_e2e runs one of them as a process)."""
    import train
    from pace.errors import UserError

    cfg = compose_cfg([f"+exp={preset}"])
    with pytest.raises(UserError, match="no CUDA GPU is available here"):
        train.run(cfg)


def test_paper_presets_evaluate_on_math6_and_tiny_on_arithmetic() -> None:
    for preset in ("pace_qwen3_8b", "async_qwen3_4b", "sync_qwen3_30b_a3b"):
        cfg = compose_cfg([f"+exp={preset}"])
        assert list(cfg.eval.benchmarks) == ["math6"] and cfg.eval.k == 32  # paper: mean@32
    assert list(compose_cfg(["+exp=pace_tiny"]).eval.benchmarks) == ["arithmetic"]
    assert compose_cfg(["+exp=pace_qwen3_8b"]).eval.every > 0  # validated in training, on the rollout engine


def test_tool_presets_use_tools_with_the_same_method_settings() -> None:
    for method in ("sync", "async", "pace"):
        tool, plain = compose_cfg([f"+exp={method}_tiny_tool"]), compose_cfg([f"+exp={method}_tiny"])
        assert tool.rollout.max_tool_calls > 0 and tool.data.source == "tool_arithmetic"
        assert tool.model.tiny.tool is not None and list(tool.eval.benchmarks) == ["tool_arithmetic"]
        assert (tool.pool, tool.algo, tool.pace) == (plain.pool, plain.algo, plain.pace)
    for method in ("sync", "async", "pace", "m2po"):
        retool, plain = compose_cfg([f"+exp={method}_qwen3_4b_retool"]), compose_cfg([f"+exp={'async' if method == 'm2po' else method}_qwen3_4b"])
        assert retool.rollout.max_tool_calls == 8 and retool.data.template == "retool"
        assert retool.model.path == "Qwen/Qwen3-4B" and retool.pool == plain.pool
        assert retool.algo.name == ("m2po" if method == "m2po" else "dapo")
        validate(retool)


def _saved_config(tmp_path: Path, overrides: list[str]) -> Path:
    ckpt = tmp_path / "run" / "checkpoints" / "step-000004"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(compose_cfg(overrides)))
    return ckpt


def test_resume_runs_with_the_checkpoints_config_and_only_resumable_changes(tmp_path: Path) -> None:
    from pace.checkpoint import resume_config

    ckpt = _saved_config(tmp_path, ["+exp=pace_tiny", "pace.gamma=2", "trainer.steps=50"])
    now = compose_cfg(["trainer.steps=80"])
    cfg = resume_config(now, ckpt, [f"resume={ckpt}", "trainer.steps=80"])
    validate(cfg)
    assert cfg.pool.name == "pace" and cfg.pace.gamma == 2  # the run's own config, not today's defaults
    assert cfg.trainer.steps == 80 and cfg.resume == str(ckpt)  # a resumable key changed
    with pytest.raises(ConfigError, match=r"pace\.gamma cannot change on resume"):
        resume_config(compose_cfg(["pace.gamma=4"]), ckpt, [f"resume={ckpt}", "pace.gamma=4"])
    with pytest.raises(ConfigError, match="exp cannot change on resume"):
        resume_config(compose_cfg(["+exp=async_tiny"]), ckpt, [f"resume={ckpt}", "+exp=async_tiny"])


def test_resume_of_a_checkpoint_saved_before_data_dedup_keeps_every_row(tmp_path: Path) -> None:
    """A checkpoint whose config predates `data.dedup` sampled from every row of the file: its
    sampler's position indexes that list, so the resume must load the same one (dedup false),
    not the schema's default (true)."""
    from pace.checkpoint import resume_config

    ckpt = _saved_config(tmp_path, ["+exp=pace_tiny"])
    old = OmegaConf.load(ckpt / "config.yaml")
    del old.data["dedup"]
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(old))
    cfg = resume_config(compose_cfg([]), ckpt, [f"resume={ckpt}"])
    assert cfg.data.dedup is False
    ckpt = _saved_config(tmp_path / "new", ["+exp=pace_tiny"])  # saved with the key: kept as saved
    assert resume_config(compose_cfg([]), ckpt, [f"resume={ckpt}"]).data.dedup is True


def test_resume_may_set_the_device_memory_and_an_old_checkpoint_resumes_without_it(tmp_path: Path) -> None:
    """The start-up memory refusal names `trainer.device_memory_gib`: a run resumed on other hardware
    must be able to set it. A checkpoint saved before the key existed resumes with it null (the check
    sizes the device itself, as before)."""
    from pace.checkpoint import resume_config

    ckpt = _saved_config(tmp_path, ["+exp=pace_tiny"])
    old = OmegaConf.load(ckpt / "config.yaml")
    del old.trainer["device_memory_gib"]
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(old))
    assert resume_config(compose_cfg([]), ckpt, [f"resume={ckpt}"]).trainer.device_memory_gib is None
    now = compose_cfg(["trainer.device_memory_gib=60"])
    assert resume_config(now, ckpt, [f"resume={ckpt}", "trainer.device_memory_gib=60"]).trainer.device_memory_gib == 60


def test_resume_finds_the_newest_checkpoint_and_names_a_bad_path(tmp_path: Path) -> None:
    from pace.checkpoint import STATE_FILE, resolve

    run = tmp_path / "run"
    for name in ("step-000004", "step-000012", "step-000016.tmp"):  # .tmp: a checkpoint cut short
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / STATE_FILE).write_bytes(b"")
    assert resolve(str(run)) == run / "checkpoints" / "step-000012"
    assert resolve(str(run / "checkpoints" / "step-000004")) == run / "checkpoints" / "step-000004"
    with pytest.raises(ConfigError, match="no such directory"):
        resolve(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no checkpoint here"):
        resolve(str(tmp_path))


# ------------------------------------------------ the documented launch commands fit the presets

LAUNCH = re.compile(r"accelerate launch --config_file (\S+)(?: --num_processes (\d+))? train\.py \+exp=(\S+)((?: [\w.]+=\S+)*)")


def _launches() -> list[tuple[str, str, int, str, list[str]]]:
    root = CONF.parent
    out = []
    for doc in ("README.md", "docs/gpu.md", "docs/tools.md"):
        for m in LAUNCH.finditer((root / doc).read_text()):
            yaml, n, preset, extra = m.groups()
            n = int(n) if n else OmegaConf.load(root / yaml).num_processes
            out.append((doc, yaml, n, preset, extra.split()))
    return out


def test_documented_launches_fill_one_node_of_8_gpus() -> None:
    """Every `accelerate launch ... train.py +exp=<paper preset>` in the README and docs: the trainer
    processes plus the preset's engines × tensor parallel size make one node of 8 GPUs, so the
    command runs the placement the preset (and its simulator scenario) describes."""
    launches = [x for x in _launches() if "qwen3" in x[3]]
    assert {"pace_qwen3_8b", "pace_qwen3_8b_h100", "pace_qwen3_4b", "pace_qwen3_4b_retool"} <= {x[3] for x in launches}
    for doc, yaml, n, preset, extra in launches:
        cfg = compose_cfg([f"+exp={preset}", *extra])
        if cfg.rollout.servers:
            continue  # engines on other nodes: the multi-node test below (servers this run starts are on this node)
        assert n + cfg.rollout.engines * cfg.rollout.tensor_parallel_size == 8, (doc, preset, n)


def test_the_30b_a3b_presets_train_on_a_node_of_8_with_engines_on_another() -> None:
    cfg = compose_cfg(["+exp=pace_qwen3_30b_a3b"])
    assert cfg.rollout.engine_process == "server" and cfg.rollout.engines * cfg.rollout.tensor_parallel_size == 8
    assert OmegaConf.load(CONF / "accelerate" / "fsdp_8gpu.yaml").num_processes == 8
    docs = (CONF.parent / "README.md").read_text() + (CONF.parent / "docs" / "gpu.md").read_text()
    assert "TP=2 ACCELERATE_CONFIG=conf/accelerate/fsdp_8gpu.yaml" in docs


def test_target_pool_is_n_star_with_null_meaning_b():
    """n* in one place (`pace.config.target_pool`): the policy, validation, the simulator's report and
    the pool figure read it from a composed config or from a run's logged config (a plain dict)."""
    from pace.config import target_pool
    from pace.pool import build_policy

    cfg = compose_cfg(["+exp=pace_tiny", "data.batch_prompts=4"])
    assert cfg.pace.target_pool is None and target_pool(cfg) == 4
    assert build_policy(cfg).controller.target_pool == 4
    cfg.pace.target_pool = 12
    assert target_pool(cfg) == 12 and build_policy(cfg).controller.target_pool == 12
    assert target_pool(OmegaConf.to_object(cfg)) == 12  # the simulator builds its policy from the object
    assert target_pool({"pace": {"target_pool": None}, "data": {"batch_prompts": 32}}) == 32
    assert target_pool({"pace": {"target_pool": 0}, "data": {"batch_prompts": 32}}) == 0  # a value, not "unset"
    assert target_pool({"data": {}}) is None  # a logged config without the keys: unknown


def test_delta_over_nccl_is_refused_at_start_on_a_mixture_of_experts_model(tmp_path: Path) -> None:
    """The 30B-A3B preset's model (transformers' own Qwen3-MoE config, as its config.json has it):
    nccl patches index the checkpoint's layout, vLLM re-lays the experts out (FusedMoE). Whole syncs,
    gloo's delta (a mirror in the checkpoint's layout, reloaded whole) and a dense model go on."""
    from types import SimpleNamespace

    from transformers import Qwen3Config, Qwen3MoeConfig

    from pace.config_checks import check_model

    moe, hub, dense = tmp_path / "moe", tmp_path / "hub", tmp_path / "dense"
    Qwen3MoeConfig(num_experts=128).save_pretrained(moe)  # transformers 5 writes it as num_local_experts
    hub.mkdir()  # the hub's Qwen3-30B-A3B-Base/config.json, written by an older transformers
    (hub / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8}')
    Qwen3Config().save_pretrained(dense)
    cfg = compose_cfg(["+exp=pace_qwen3_30b_a3b", "rollout.weight_delta=true"])
    nccl, gloo = SimpleNamespace(transfer="nccl"), SimpleNamespace(transfer="gloo")
    for path, key in ((moe, "num_local_experts"), (hub, "num_experts")):
        with pytest.raises(ConfigError, match=rf"^rollout\.weight_delta=true over rollout\.weight_transfer=nccl: .*{path.name} "
                                              rf"is a mixture-of-experts model \({key}=128\), .*: set rollout\.weight_delta=false$"):
            check_model(cfg, nccl, str(path))
    check_model(cfg, gloo, str(moe))
    check_model(cfg, nccl, str(dense))
    cfg.rollout.weight_delta = False
    check_model(cfg, nccl, str(moe))
