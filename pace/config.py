"""Typed schema of every config group (the names of docs/design.md), registered with Hydra's ConfigStore.

`conf/config.yaml` starts from the `pace_schema` node, so an unknown key or a value of the wrong
type fails at composition naming the key. Value constraints that types cannot express are checked
by `validate` (pace/config_checks.py), once, at start. Derived values are computed here and nowhere else. The schema itself
needs neither Hydra nor OmegaConf (scripts/gpu_smoke.py builds a `Config` where only torch,
transformers and accelerate are installed).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional

from pace.tasks.arithmetic import ArithmeticSpec
from pace.tasks.tool_arithmetic import ToolArithmeticSpec
from pace.tiny_spec import TinySpec

if TYPE_CHECKING:
    from omegaconf import DictConfig


@dataclass
class ModelConfig:
    # Hub id or local directory. `null`: the embedded tiny model (committed in data/tiny/, or built into `cache_dir`).
    path: Optional[str] = None
    dtype: str = "float32"  # trainer and engine dtype: float32 | bfloat16 | float16
    gradient_checkpointing: bool = False
    attn_implementation: Optional[str] = None  # transformers' choice when null (sdpa); flash_attention_2 for varlen packing
    cache_dir: str = "data/cache"  # where built assets (tiny model) are cached
    tiny: TinySpec = field(default_factory=TinySpec)  # used when path is null


@dataclass
class DataConfig:
    # arithmetic (generated, tiny default) | tool_arithmetic (generated, for tool use) | math (hub id or local file)
    source: str = "arithmetic"
    path: Optional[str] = None  # math: hub id (datasets.load_dataset) or a local .jsonl/.parquet file
    split: str = "train"
    # math: one prompt per distinct problem, its first row's (a problem whose rows disagree on the
    # answer is dropped); the counts are printed at load. false: every row, as the file has it
    # (BytedTsinghua-SIA/DAPO-Math-17k repeats its ~17.9k rows 100 times: conf/data/dapo_math.yaml)
    dedup: bool = True
    template: str = "dapo"  # math prompt template: dapo | retool (tool use) | plain (see pace.tasks.math)
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template
    # With chat_template: every request (rollout turns, validation, eval.py, remote servers) also
    # stops on the token the template ends an assistant turn with (pace/rollout/stopping.py);
    # false: the checkpoint's EOS only (checkpoints saved before this key resume with false)
    stop_on_turn_end: bool = True
    # Qwen3's chat template switch (`enable_thinking`), passed to it when not null; null: the
    # template's own default (Qwen3's hybrid models think by default; the Base models' presets leave it)
    enable_thinking: Optional[bool] = None
    # Prompts longer than this (tokens) are dropped at load, with one warning naming the source and
    # the count; prompts that cannot fit rollout.max_model_len with rollout.max_tokens always are.
    max_prompt_tokens: Optional[int] = None
    batch_prompts: int = 8  # B: groups per training step
    group_size: int = 8  # G: responses per prompt
    seed: int = 0
    arithmetic: ArithmeticSpec = field(default_factory=ArithmeticSpec)  # used when source=arithmetic
    tool_arithmetic: ToolArithmeticSpec = field(default_factory=ToolArithmeticSpec)  # source=tool_arithmetic


@dataclass
class RolloutConfig:
    max_tokens: int = 96  # L_max (also the overlong-shaping limit)
    overlong_buffer: int = 16  # L_cache (DAPO soft overlong punishment)
    temperature: float = 1.0
    top_p: float = 1.0
    # Cap on groups submitted and not yet pooled. The tiny default's 128 groups (1024 sequences)
    # make production outrun training on 2 CPU cores, so an unfiltered pool builds a backlog as
    # in the paper's runs (docs/pool-policies.md "The backlog").
    max_inflight_groups: int = 128
    # A checkpoint (a stop's or a periodic one) keeps the groups in flight: finished responses, and
    # each unfinished one's tokens with their log-probs and versions; `resume=` continues them
    # (prompt + kept tokens prefilled, the rest generated under the resumed weights). false: they
    # are dropped, their prompts returned to the sampler (docs/checkpoints.md "Checkpoints, resume and failures").
    resume_inflight: bool = True
    sync_every: int = 1  # weight sync every N training steps
    # What an in-flight request attends to after a weight update (docs/pool-policies.md "KV staleness"):
    # keep: the keys and values its prompt and earlier tokens got under the older weights (vLLM's
    # pause "keep": no recomputation; its later tokens' context is stale, counted in K_kv) |
    # recompute: every in-flight request is prefilled again under the new weights (vLLM preempts the
    # running requests at the update: `reset_prefix_cache(reset_running_requests=True)`), so K_kv = K_gen;
    # the cost is logged (`rollout/reprefill_tokens`)
    kv_on_update: str = "keep"
    # The stale-KV probe (pace/rollout/kv_probe.py): this share of the responses whose last request
    # spans an update (drawn from data.seed) is prefilled again whole when it finishes, under the
    # weights of its last token; the mean |ℓ^μ − ℓ_fresh| of its tokens generated after the update is
    # `mismatch/kv_abs_logp_diff` (their count `mismatch/kv_tokens`): the cost of keep's stale
    # context, the float floor under recompute. One prefill each, ahead of generation. Needs
    # rollout.temperature=1 (vLLM's prompt log-probs are untempered). 0: off
    kv_probe: float = 0.0
    # The reload probe at the start (pace/rollout/reload_probe.py, docs/weight-sync.md "The reload probe"):
    # every engine that loaded θ_0 from disk scores one prompt, is sent θ_0 again, and scores it again;
    # a shift above reload_probe_tolerance stops the run naming the engine (stop), is a warning (warn),
    # or is not looked for (off). In server runs (θ_0 is published at the start anyway), at a resume
    # and for MoE models (there one more whole update at the start, before the checkpoint's weights)
    reload_probe: str = "stop"
    # the largest |Δ log-prob| over the probe's prompt tokens; null: 1e-5 for model.dtype float32, 1e-2
    # for bfloat16/float16 (a correct reload moves nothing on bit-reproducible kernels)
    reload_probe_tolerance: Optional[float] = None
    weight_delta: bool = False  # after a full sync, send only the elements whose engine-dtype value changed (docs/weight-sync.md)
    full_sync_every: int = 100  # with weight_delta: a full sync every N versions (0: only at start, resume and engine join)
    delta_max_frac: Optional[float] = None  # with weight_delta: a full sync when more than this fraction changed (null: where the bytes break even)
    # with weight_delta over nccl: an engine worker receives at most this many MiB of patches (indices and values)
    # on its GPU before it applies them in place (a tensor whose patch is larger: alone), plus one tensor's staging
    delta_chunk_mib: int = 512
    max_model_len: int = 256
    max_num_seqs: int = 1024  # sequences the engine runs at once (vLLM max_num_seqs)
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    # Grade each finished group before the next engine step, so the engine step at which a
    # regenerated group (dynamic sampling) starts is the same in every run: with pool=sync and a
    # fixed seed the run is repeatable, and a resumed run equals it. Off by default: it puts the
    # grading latency on the rollout's path. Asynchronous runs stay timing-dependent either way.
    deterministic: bool = False
    # CPU engine only: KV cache GiB, and OMP threads/binding of the engine (see docs/gpu.md "CPU threads").
    kv_cache_gib: int = 1
    cpu_threads: int = 1
    cpu_threads_bind: str = "nobind"
    # CPU only: the rollout's processes (child engine cores, servers the run starts, the stream reader,
    # grading workers) run this much nicer than the trainer, which then keeps a core while they generate
    # (0-19; pace/priority.py, docs/benchmarks.md "Process layouts on 2 cores")
    engine_nice: int = 0
    # Multi-turn tool use (ReTool): tool calls per response; 0 = single-turn. Generation stops at
    # `</code>`, the program runs in the sandbox (`tools`), its output is appended between
    # interpreter tags and generation resumes; the response budget (max_tokens) counts both.
    max_tool_calls: int = 0
    # Placement (pace/rollout/engine.py, docs/gpu.md "Paper runs on GPUs"). `engines` data-parallel
    # vLLM engines of `tensor_parallel_size` GPUs each; their cores run in this process (inproc)
    # or in their own (child). auto: inproc for one trainer process on CPU, else child.
    engines: int = 1
    engine_process: str = "auto"  # auto | inproc | child | server
    # a generation request's new tokens reach the rollout thread every this many tokens (and at its end;
    # vLLM's stream_interval): the per-token work on rank 0 shrinks with it (docs/benchmarks.md "The
    # rollout client's cost"); > 1: in-process and child engines lose at a stop up to this − 1 tokens a
    # request had not delivered (generated again; a server's unfinished turn is cut at a stop anyway), and
    # in-process stamps are no longer checked against vLLM's versions token by token
    stream_interval: int = 1
    # server: the engines are vLLM HTTP servers (pace/rollout/remote.py, docs/gpu.md "Rollout engines on
    # other nodes"): these URLs (http://host:port, started by scripts/launch_rollout_server.sh on any
    # host), or, when empty, `engines` servers this run starts on 127.0.0.1 and stops at its end
    servers: list[str] = field(default_factory=list)
    # server: who reads the generation streams: a child process (process; rank 0 gets packed arrays, a
    # message every few ms: the per-token JSON parsing off the trainer's GIL, pace/rollout/streams.py) or
    # a thread of rank 0's process (thread; docs/benchmarks.md "The rollout client's cost")
    stream_reader: str = "process"
    # a server that dies, stalls or fails its health checks: continue on the others (its requests
    # go to a live one; warning, `rollout/engines_alive`) | stop (checkpoint, the cause named)
    on_engine_failure: str = "continue"
    # continue: a failed server is started again (one this run started: same flags and GPUs, new port)
    # or, given by URL, re-admitted once it answers; it rejoins the weight-transfer group at the next
    # update, caught up with θ whole and checked (pace/rollout/healing.py). At most this many restarts
    # in the run (0: a failed server stays out), each after restart_backoff_s·2^k (≤ 60 s)
    max_engine_restarts: int = 3
    restart_backoff_s: float = 2.0
    # a drained server (python -m pace.rollout.fleetctl drain): its requests still running this long
    # after the drain go to the other servers, as a failed server's do
    drain_timeout_s: float = 300.0
    # server mode: rank 0's HTTP control endpoint (pace/rollout/control.py), through which servers join the
    # running fleet and leave it (`python -m pace.rollout.fleetctl`, docs/gpu.md "A fleet that heals and
    # grows"); its URL is written to <run dir>/fleet.json. 0: a free port; null: no endpoint.
    control_port: Optional[int] = 0
    # server mode: the address the control endpoint listens on (null: the one the servers reach rank 0 at,
    # as `transfer_address`: 127.0.0.1 when every server is on this host). No authentication: whoever
    # reaches it can add or drain servers (a joining server is sent the weights); 0.0.0.0 on a trusted network only
    control_host: Optional[str] = None
    # server mode: a server with requests in flight that neither delivers output nor makes progress (the
    # prompt and generation tokens its /metrics count) for this long, or an update call (pause, resume,
    # label, check) that takes this long, has failed
    engine_timeout_s: float = 120.0
    # nccl/gloo: the deadline of a weight update's transfer (the broadcast and every engine's update
    # call; not the wait for a validation in progress). Past it the transfer group is aborted, every
    # trainer rank leaves the update together and writes a checkpoint, and the run stops naming the
    # cause (`resume=` goes on): an engine that dies inside the broadcast cannot hang the run
    update_timeout_s: float = 600.0
    # server mode: servers this run starts must answer /health by then; engines built at once on
    # GPUs of their own (child): each build must have spawned its engine core process by then
    server_start_timeout_s: float = 900.0
    # server mode, nccl/gloo weight transfer: the address of trainer rank 0 the servers connect to
    # (null: 127.0.0.1 when every server is on this host, else this host's address toward the first).
    # A run on 127.0.0.1 refuses servers of other hosts (fleetctl join): set it to take them
    transfer_address: Optional[str] = None
    # GPU: separate (engines on GPUs of their own: `gpus`, default the ones after the trainer's)
    # or colocate (the engines share rank 0's GPU with the trainer: a single-GPU run).
    placement: str = "separate"
    gpus: Optional[list[int]] = None  # indices as this process sees its GPUs (mapped through CUDA_VISIBLE_DEVICES)
    # vLLM weight-transfer backend: auto (shm on CPU; on GPU nccl, or ipc when colocated) | shm
    # (pace/weights/transfer.py: a /dev/shm file, engines on trainer rank 0's host) | nccl | ipc (vLLM's)
    weight_transfer: str = "auto"


@dataclass
class ToolsConfig:
    """The sandbox of multi-turn tool rollouts (rollout.max_tool_calls > 0): pace/tools."""

    sandbox: str = "bwrap"  # bwrap (bubblewrap: no network, read-only fs, private /tmp) | process (no isolation)
    workers: int = 4  # tool calls running at once (threads beside the engine)
    warm: int = 0  # sandboxes kept started, waiting for a program (hides start-up)
    wall_s: float = 10.0  # per call
    cpu_s: int = 5
    memory_mb: int = 1024
    output_bytes: int = 4096  # output read from the program (it is stopped past this)
    output_chars: int = 512  # interpreter text appended to the context (head + tail kept)


@dataclass
class RewardConfig:
    timeout_s: float = 5.0  # per grading job (math-verify); a timeout scores as wrong and is counted
    workers: int = 1  # grading processes
    # Answers in a row that could not be graded (timeouts, errors) after which the run stops with
    # the cause: every group would be filtered and the trainer would wait forever. 0: never.
    max_failed_in_row: int = 512


@dataclass
class PoolConfig:
    # sync | async | stale_k | gate | pace, or a policy of your own by import path,
    # `my_package.module:MyPolicy` (docs/pool-policies.md "Writing a pool policy")
    name: str = "async"
    # Keyword arguments of a policy given by import path (`+pool.args.keep=3`); unused by the built-in ones
    args: Dict[str, Any] = field(default_factory=dict)
    max_lag: float = 4.0  # stale_k: drop at consumption when K > max_lag
    max_head_offpolicyness: int = 4  # gate: η, generation at most η batches ahead of training
    # Hard cap on pooled + in-flight groups (every policy): at capacity no group starts until the
    # trainer takes some (back-pressure; nothing is discarded; `rollout/capacity_wait_s`), so host
    # memory stays bounded when production outruns training. null: no cap.
    capacity: Optional[int] = 1024
    # Observe only: the share of groups (0: off, 1: all, 0.125: a fixed eighth by id) that get PACE's
    # PFS, u and S_eff (pace.gamma, pace.score_window, pace.prefix_tokens) recorded when decided, without
    # changing any decision; the rescoring costs engine time, logged in time/rescore (docs/pool-policies.md
    # "Effective Staleness for the record"). Nothing to do for pool.name=pace with pace.score=effective.
    record_effective: float = 0.0


@dataclass
class PaceConfig:
    """PACE (pool.name=pace): docs/design.md §3, Algorithm 1."""

    score: str = "effective"  # effective | raw | generation
    gamma: float = 1.0  # sharpening of the PFS percentile u (paper: 1, 2, 4)
    target_pool: Optional[int] = None  # n*, in groups; null = B
    ema: float = 0.9  # β of the rejection rate ρ
    score_window: int = 512  # PFS values the percentile rank u is taken over
    prefix_tokens: int = 16  # m: response tokens rescored for the PFS
    # Which of the R_j highest-scoring groups are rejected at step j (docs/pool-policies.md "Selection"): `pool`
    # rejects all of them, wherever they are in the pool; `draw` (the paper's wording: the trainer
    # draws groups in completion order, filtering, until it has B) only those drawn before the B-th
    # kept group; the others stay pooled. The batch of step j is the same under both.
    selection: str = "pool"
    # Rank by the KV staleness K_kv instead of K_gen in the effective score, S_eff = K_wait + u^γ K_kv
    # (docs/pool-policies.md "KV staleness"): tokens written on an older context count as old as it.
    # raw and generation take K_kv in K_gen's place too, and pool.record_effective records this S_eff.
    # The same as K_gen under rollout.kv_on_update=recompute.
    kv_aware: bool = False


@dataclass
class AlgoConfig:
    name: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    clip_ratio_c: Optional[float] = 3.0  # dual clip for A < 0 (verl's DAPO recipe), > 1; null disables
    ratio_ref: str = "behavior"  # behavior (π_θ/μ) | proximal (decoupled PPO: π_θ/π_prox × w(π_prox/μ))
    # Importance-sampling correction of ρ = π_prox/μ (proximal) or sg(π_θ)/μ (behavior), pace/algo/correction.py:
    # none | tis (truncate at is_threshold) | mis (mask outside [is_threshold_lower, is_threshold])
    is_correction: str = "none"
    is_level: str = "token"  # token | sequence (Π ρ) | geometric ((Π ρ)^(1/n); mis only)
    is_threshold: Optional[float] = None  # C; needed by tis and mis
    is_threshold_lower: Optional[float] = None  # mis: lower bound; null: 1/C
    m2_threshold: float = 0.04  # algo.name=m2po: τ, the trust-region tokens' second-moment budget
    m2po_variant: str = "paper"  # paper (Algorithm 1: mask, no clip) | adaptive_clip (the authors' code)
    m2po_eps_low_min: float = 0.3  # adaptive_clip: ε_low at least this (a floor: the authors' miniclip_low)
    m2po_eps_high_min: float = 0.5  # adaptive_clip: ε_high at least this (a floor: the authors' miniclip_high)
    filter_on: str = "acc"  # dynamic sampling on correctness (DAPO's recipe) or on the shaped reward
    adv_eps: float = 1e-6
    # group-advantage std with Bessel's correction (n − 1), as verl's DAPO recipe (torch.std) and AReaL
    std_unbiased: bool = True
    # MoE routing replay: the engine returns the experts each token was routed to (vLLM's routed
    # experts) and the trainer's forward uses them instead of its router's top-k (pace/algo/routing_replay.py)
    routing_replay: bool = False


@dataclass
class TrainerConfig:
    steps: int = 100
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 10  # linear warm-up: Adam's first steps are sign-like and large
    grad_clip: float = 1.0
    mini_batches: int = 1  # optimizer updates per training step
    micro_batch_size: int = 64  # sequences per forward/backward (when max_tokens_per_micro_batch is null)
    # Micro-batches by token count instead (pace/algo/microbatch.py): each costs at most this many
    # tokens (Σ lengths packed, rows × longest padded), balanced across ranks. null: by count.
    max_tokens_per_micro_batch: Optional[int] = None
    packing: bool = False  # a micro-batch's sequences in one row, no padding (position_ids; varlen attention)
    # Response positions per chunk of the log-prob/entropy computation (pace/algo/logprobs.py); peak
    # memory ~12 bytes × vocabulary × chunk. null: the full-vocabulary reference path (all positions at once).
    logprob_chunk: Optional[int] = 1024
    grad_sync: str = "auto"  # auto (FSDP: every micro-batch; DDP: last) | every | last (no_sync before)
    # With Accelerate mixed precision (bf16 on GPUs) and no FSDP (DDP, one device): the dtype of the
    # parameters, gradients and AdamW state. Under FSDP2 they are float32 whatever this says:
    # Accelerate upcasts every trainable parameter to fp32 once mixed precision is on
    # (accelerate.utils.fsdp_utils.fsdp2_prepare_model). Ignored without mixed precision (CPU:
    # model.dtype throughout).
    master_dtype: str = "float32"
    # With mixed precision under FSDP2: the dtype gradients are reduce-scattered in (MixedPrecisionPolicy)
    reduce_dtype: str = "float32"
    # Memory of one trainer device (GiB) that the start-up check holds the trainer's weights,
    # gradients and AdamW state to (pace/algo/memory_check.py). null: the GPU's total (less a colocated
    # engine's share); on CPU no check.
    device_memory_gib: Optional[float] = None
    # Host memory (GiB) of one node that the start-up check holds the trainer's model load to
    # (pace/algo/memory_check.py check_host_memory). null: what the node has available (MemAvailable,
    # within the job's cgroup v2 memory limit).
    host_memory_gib: Optional[float] = None
    cpu_threads: int = 1  # torch intra-op threads of the trainer on CPU
    # Timeouts of the waits between trainer processes (pace/control.py): the trainer's collectives
    # (null: torch's default, 10 min for NCCL, 30 for gloo), and the stop/go decisions and barriers
    # that wait on rank 0's long work (engine start, first batch, validation, downloads, checkpoints).
    dist_timeout_s: Optional[int] = None
    control_timeout_s: int = 14400
    # Checkpoint every N steps and after the last (0: only when stopped by SIGTERM/SIGINT or a
    # failure); <run>/checkpoints/step-N, the newest `keep_checkpoints` kept. See pace/checkpoint.py
    # (the best validated version has its own copy, <run>/best: pace/validation.py).
    save_every: int = 0
    keep_checkpoints: int = 2
    # The engines compute with the trainer's weights (pace/weights/mismatch.py): on-policy tokens' mean
    # |ℓ^μ − log π_θ| above this warns once, and `sync_mismatch_steps` measured steps above it in a
    # row stop the run (0: warn only). null: 1e-5 for model.dtype float32, 0.2 for bfloat16/float16.
    max_sync_mismatch: Optional[float] = None
    sync_mismatch_steps: int = 3
    # After every weight sync, each engine worker's fingerprints of the tensors its served model's
    # loader received must equal the trainer's of what it sent for that version (pace/weights/fingerprint.py):
    # exact in any dtype, where `max_sync_mismatch` cannot see an engine a version behind in bf16.
    # Any other weights, or none, stop the run after a checkpoint.
    sync_fingerprint: bool = True


@dataclass
class LoggerConfig:
    mode: str = "offline"  # online | offline | disabled (online falls back to offline without an API key)
    project: str = "pace"
    group: Optional[str] = None
    name: Optional[str] = None
    tags: list = field(default_factory=list)
    flush_every: int = 10  # steps between writes of per-group Parquet parts
    progress: bool = True


@dataclass
class EvalConfig:
    """mean@k evaluation (`eval.py`, and in-training validation on the rollout engine)."""

    benchmarks: list = field(default_factory=lambda: ["arithmetic"])  # names or sets (math6, arithmetic)
    data_dir: Optional[str] = None  # local copies <name>.jsonl; null: the hub ids
    k: int = 8  # samples per problem (the paper: mean@32)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: Optional[int] = None  # null: rollout.max_tokens
    every: int = 0  # in-training validation every N steps on the rollout engine (0: off)
    at_start: bool = True  # also validate θ_0 (before any update) when every > 0
    val_max_problems: Optional[int] = None  # in-training validation: first N problems of each set (null: all)
    val_k: Optional[int] = None  # in-training validation: samples per problem (null: k)
    best_within: Optional[int] = None  # <run>/best: the best validation among versions <= N (null: the whole run)
    # The validation sets the paper's figures name (analysis/trajectories.py): Figure 5 draws each,
    # Figures 3 and 9 the first. Names as logged (`val/<set>/mean@k`); empty: the last two logged.
    figure_sets: list = field(default_factory=list)


@dataclass
class RehearsalConfig:
    """A paper preset rehearsed on a CPU (`+rehearsal=cpu`, pace/rehearsal/overlay.py): what a CPU
    cannot have is swapped at start (each swap printed), everything else is the preset's."""

    enabled: bool = False
    applied: bool = False  # set when the swaps are made: a resumed rehearsal keeps its config as saved
    # trainer.steps of the rehearsal (null: the preset's first periodic checkpoint and half a validation
    # interval after it: a checkpoint, validations before and after it, the final ones)
    steps: Optional[int] = None
    # data.batch_prompts of the rehearsal, rollout.max_inflight_groups scaled with it (the preset's groups in
    # flight a prompt of the batch kept). null: the preset's batch
    batch_prompts: Optional[int] = None
    engines: int = 2  # at most this many of the preset's rollout engines (of the preset's kind)
    # The Accelerate config the preset is launched with (`accelerate launch --config_file`): its FSDP2
    # plugin shards the trainer over the rehearsal's processes (gloo; Accelerate alone keeps DDP on a
    # CPU: pace/rehearsal/fsdp.py), and its mixed precision is the trainer's. null: DDP, float32
    accelerate_config: Optional[str] = "conf/accelerate/fsdp.yaml"
    # One factor on the healing timeouts (engine_timeout_s, update_timeout_s, drain_timeout_s,
    # restart_backoff_s), so that they bite at CPU speed (docs/rehearsal.md)
    time_scale: float = 0.25
    # Faults injected into the servers this run starts (pace/rehearsal/faults.py): engine `slow_engine`'s
    # engine core runs 1/`slow_factor` of each second while it validates θ_`slow_version` (null: every
    # validation; stopped and continued, SIGSTOP and SIGCONT: 200 is about one engine step a second); the
    # weight update to θ_`block_update` finds engine `block_engine`'s engine core frozen (SIGSTOP) as its
    # transfer begins. null: none
    slow_engine: Optional[int] = None
    slow_version: Optional[int] = None
    slow_factor: float = 200.0
    block_update: Optional[int] = None
    block_engine: int = 1


@dataclass
class Config:
    exp_name: str = "default"
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    # A checkpoint directory, or a run directory (its newest checkpoint): continue that run, in its
    # directory and wandb run, with its config (only pace.checkpoint.RESUMABLE keys may change).
    resume: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    pace: PaceConfig = field(default_factory=PaceConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rehearsal: RehearsalConfig = field(default_factory=RehearsalConfig)


# Config keys added after checkpoints existed -> the value that reproduces a run from before them
# (`saved_config`). data.dedup: a run from before it sampled every row of the file (its sampler's
# position indexes that list, and returned prompt ids may be rows the deduplicated list does not have).
# data.stop_on_turn_end: a run from before it stopped templated responses on the checkpoint's EOS only.
KEYS_ADDED = {"data.dedup": False, "data.stop_on_turn_end": False}


def saved_config(path, cfg: DictConfig, overrides: list[str], keep=lambda key: False) -> DictConfig:
    """A saved config (a checkpoint's, a run's `.hydra/config.yaml`) under the schema (keys added
    since it was saved get their defaults), with the values ``cfg`` (this command line's) has for
    each key ``overrides`` set, except those ``keep(key)`` leaves as saved."""
    from omegaconf import OmegaConf

    written = OmegaConf.load(path)
    saved = OmegaConf.merge(OmegaConf.structured(Config), written)
    # Keys added after runs were saved, whose schema default changes what the run does: a saved
    # config without one keeps the behaviour it was written under.
    for key, before in KEYS_ADDED.items():
        if OmegaConf.select(written, key, default=None) is None:
            OmegaConf.update(saved, key, before, merge=False)
    for key in override_keys(overrides):
        if not keep(key):
            OmegaConf.update(saved, key, OmegaConf.select(cfg, key), merge=False)
    return saved


def override_keys(overrides: list[str]) -> list[str]:
    """The keys of command-line overrides (`key=value`, `+key=value`, `~key`)."""
    return [override.split("=", 1)[0].lstrip("+~") for override in overrides]


def target_pool(cfg) -> int | None:
    """n*, the pool size PACE steers to: `pace.target_pool`, null = B (`data.batch_prompts`). Takes a
    composed config, its object form (the simulator's) or a run's logged one (a plain dict); None
    when the latter lacks both keys."""
    def get(node, key):
        return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)

    n = get(get(cfg, "pace") or {}, "target_pool")
    return get(get(cfg, "data") or {}, "batch_prompts") if n is None else n


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="pace_schema", node=Config)
