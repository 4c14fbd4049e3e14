"""The embedded default model: a tiny Qwen3 with a character-level tokenizer, SFT-warmed on
the generated arithmetic task to partial accuracy, built once and cached on disk.

RL needs signal: a model that solves everything or nothing gives groups whose rewards are
all equal, and dynamic sampling filters those. A model that is simply undertrained gives
signal but RL barely moves it (+1 point in 100 steps). So the warm start trains
long enough to do every level (``TinySpec.sft_steps``) on traces of which a fraction
(``TinySpec.error_fraction``) carries one slipped step: the model samples slips at
temperature 1 (~37% correct on the training mix, falling with the level), and RL can remove
them (+24 to +26 points of validation in 100 steps of `+exp=sync_tiny`, docs/benchmarks.md "Measured").
``meta.json`` in the built directory records what was measured.

The directory is a plain Hugging Face checkpoint (float32 safetensors + tokenizer files):
``AutoModelForCausalLM``, ``AutoTokenizer`` and ``vllm.LLM(path, dtype="float32")`` load it.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import platform
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Regex, decoders, models, pre_tokenizers
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from pace.tasks import tool_arithmetic
from pace.tasks.arithmetic import (
    ANSWER_PREFIX,
    make_prompts,
    prompt_text,
    random_expression,
    solution,
)
from pace.tasks.arithmetic import _steps as arithmetic_steps
from pace.tasks.base import Prompt
from pace.tiny_spec import BUILD_VERSION, TinySpec

log = logging.getLogger(__name__)

# The default models (`TinySpec()` and conf/model/tiny_tool.yaml's), built here once and committed so that a
# fresh clone trains at once instead of after a 7-27 min build (data/tiny/README.md; scripts/ship_tiny.py
# rebuilds them). A spec of another key is built into the cache as before.
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "tiny"


def shipped_specs() -> dict[str, TinySpec]:
    """name → spec of each model `SHIPPED` holds: the default and the tool model of conf/model/tiny_tool.yaml."""
    from omegaconf import OmegaConf

    tool_yaml = OmegaConf.load(SHIPPED.parents[1] / "conf" / "model" / "tiny_tool.yaml")
    tool = OmegaConf.merge(OmegaConf.structured(TinySpec), tool_yaml.tiny)
    return {"default": TinySpec(), "tool": OmegaConf.to_object(tool)}

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
VOCAB_SIZE = 128
# One token per character: every printable ASCII character plus newline and tab, so any
# ASCII text round-trips; ids past them up to VOCAB_SIZE are reserved specials, which keeps the
# tokenizer and the embedding the same size (a sampled id always decodes).
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]




def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: ids 0/1/2 are pad/EOS/unk, then one id per character."""
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - 3 - len(CHARS))]
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARS, *reserved])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # "[\s\S]", not ".": Oniguruma's "." skips "\n", and "\n\n" would become one unknown piece.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, EOS, UNK, *reserved])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,  # the default would rewrite " ." and similar
        model_max_length=256,
    )


def model_config(spec: TinySpec, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny(spec: TinySpec, cache_dir: str | Path, progress: bool = True, shipped: bool = True) -> Path:
    """Return the directory of the model ``spec`` describes: the committed one under `SHIPPED` if
    there is one (and ``shipped``), else the cache's, built on the first call.

    The build writes into a temporary sibling directory and renames it into place, so a
    crash never leaves a half-built cache. Builders of one spec take turns on a lock file beside
    it (the ranks of a launch, parallel test workers): one builds, the others wait and load its
    result.
    """
    name = f"tiny-{spec.key()}"
    if shipped and (SHIPPED / name / "meta.json").exists():
        return SHIPPED / name
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    if (target / "meta.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock(cache_dir / f".{target.name}.lock")
    try:
        if not (target / "meta.json").exists():
            _build_into(spec, target, progress)
    finally:
        if lock is not None:
            os.close(lock)  # releases the lock
    return target


def _lock(path: Path) -> int | None:
    """An exclusive flock on ``path`` (created), waited for; its descriptor, or None where the file
    system has no flock (Lustre without -o flock, ...): then builders may race, and the rename keeps one."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # NFS's flock needs a writable descriptor
        try:
            os.fchmod(fd, 0o644)  # readable by the other users of a shared cache, whatever the umask
        except OSError:
            pass  # another user's file
    except PermissionError:  # another user's lock file
        fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build of %s", path.name[1:-len(".lock")])
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        os.close(fd)
        log.warning("no lock on %s (%s): building without one", path, exc)
        return None
    return fd


def _build_into(spec: TinySpec, target: Path, progress: bool) -> None:
    cache_dir = target.parent
    log.info("building tiny model (SFT %d steps) into %s", spec.sft_steps, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    try:
        (_build_moe if spec.experts else _build)(spec, tmp, progress)
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp (and safetensors) make them private; the cache is shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError:  # a builder without the lock (no flock here, an older checkout) finished first: theirs is as good
            if not (target / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build(spec: TinySpec, out: Path, progress: bool) -> None:
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer()
    model = Qwen3ForCausalLM(model_config(spec, tokenizer))
    final_loss = _sft(model, tokenizer, spec, progress)
    model.eval()
    if spec.tool is None:
        stats = _measure(model, tokenizer, make_prompts(spec.task, "train")[: spec.eval_prompts], spec)
    else:
        stats = _measure_tool(model, tokenizer, tool_arithmetic.make_prompts(spec.tool, "train")[: spec.eval_prompts], spec)
    model.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {
        "spec": asdict(spec),
        "key": spec.key(),
        "build_version": BUILD_VERSION,
        "n_params": sum(p.numel() for p in model.parameters()),
        "sft_steps": spec.sft_steps,
        "sft_final_loss": final_loss,  # EMA of the per-token response loss
        **stats,
        "build_seconds": round(time.perf_counter() - start, 1),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _build_moe(spec: TinySpec, out: Path, progress: bool) -> None:
    """The dense model of ``spec`` (built first if need be, into the same cache) upcycled into an MoE
    (pace/tiny_moe.py), checked to compute the dense model's logits."""
    from pace.tiny_moe import upcycle

    start = time.perf_counter()
    dense_dir = build_tiny(spec.dense(), out.parent, progress)
    dense = Qwen3ForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    moe = upcycle(dense, spec.experts, spec.experts_per_token, seed=spec.seed)
    tokenizer = build_tokenizer()
    ids = tokenizer([p.text for p in make_prompts(spec.task, "val")[:8]], return_tensors="pt", padding=True)
    with torch.no_grad():
        shift = (moe(**ids).logits - dense(**ids).logits).abs().max().item()
    if shift > 1e-4:
        raise RuntimeError(f"the upcycled tiny MoE does not compute its dense model's logits (max shift {shift:.2e})")
    moe.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = json.loads((dense_dir / "meta.json").read_text())
    meta.update(spec=asdict(spec), key=spec.key(), upcycled_from=dense_dir.name, experts=spec.experts,
                experts_per_token=spec.experts_per_token, logit_shift=shift,
                n_params=sum(p.numel() for p in moe.parameters()), build_seconds=round(time.perf_counter() - start, 1))
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _val_texts(spec: TinySpec) -> set[str]:
    """The val prompts of the task SFT draws from (never trained on)."""
    if spec.tool is None:
        return {p.text for p in make_prompts(spec.task, "val")}
    return {p.text for p in tool_arithmetic.make_prompts(spec.tool, "val")}


def _sft_examples(spec: TinySpec, rng: random.Random, n: int, val: set[str]) -> list[tuple[str, list[tuple[str, bool]]]]:
    """``n`` fresh (prompt, response segments) pairs outside ``val``; a segment's flag says whether it
    is trained on (the interpreter text of a tool trace is context, as in the rollout)."""
    levels = (spec.task if spec.tool is None else spec.tool).level_list()
    out = []
    while len(out) < n:
        if spec.tool is None:
            text = prompt_text(random_expression(rng, rng.choice(levels)))
            worked = solution(Prompt(id="", text=text, answer=""))
            if spec.direct_fraction and rng.random() < spec.direct_fraction:
                worked = worked[worked.rindex(ANSWER_PREFIX):]  # the answer line alone
            elif spec.error_fraction and rng.random() < spec.error_fraction:
                worked = _with_slip(text, rng)
            segments = [(worked, True)]
        else:
            text = tool_arithmetic.random_expression(rng, rng.choice(levels)) + "=?\n"
            prompt = Prompt(id="", text=text, answer="")
            if rng.random() < spec.tool_fraction:
                call, output, answer = tool_arithmetic.tool_segments(prompt)
                segments = [(call, True), (output, False), (answer, True)]
            else:
                segments = [(tool_arithmetic.direct_solution(prompt), True)]
        if text not in val:
            out.append((text, segments))
    return out


def _with_slip(text: str, rng: random.Random) -> str:
    """The worked solution of ``text`` with one step's result 1-9 too high and the
    later steps carried on from it, so the answer is wrong the way a slip makes it wrong."""
    steps = arithmetic_steps(text.removesuffix("=?\n"))
    slip = rng.randrange(len(steps))
    total, lines = steps[0][0], []
    for i, (_, op, x, _) in enumerate(steps):
        result = total - x if op == "-" else total + x
        if i == slip:
            result += rng.randint(1, 9)  # upwards: a later subtraction never goes below 0
        lines.append(f"{total}{op}{x}={result}")
        total = result
    return "\n".join(lines) + f"\n{ANSWER_PREFIX}{total}"


def _sft(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, spec: TinySpec, progress: bool) -> float:
    """Teacher-forced SFT on worked solutions (or tool/direct traces); loss on response tokens and EOS only.

    Problems come fresh from the generator (never a val prompt), not from the train split,
    so the warm start cannot memorise the prompts RL will train on.
    """
    rng = random.Random(f"tiny-sft-{spec.seed}")
    val = _val_texts(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            return spec.lr * (step + 1) / spec.warmup_steps
        t = (step - spec.warmup_steps) / max(1, spec.sft_steps - spec.warmup_steps)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    bar = tqdm(range(spec.sft_steps), desc="tiny SFT", disable=not progress, mininterval=1.0)
    ema = float("nan")
    for step in bar:
        input_ids, attention_mask, labels = _sft_batch(tokenizer, _sft_examples(spec, rng, spec.batch_size, val))
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
    return round(ema, 4)


def _sft_batch(tokenizer: PreTrainedTokenizerFast, examples: list[tuple[str, list[tuple[str, bool]]]]) -> tuple[torch.Tensor, ...]:
    """Segments are tokenized separately, as the rollout tokenizes the interpreter text it appends."""
    seqs, targets = [], []
    for prompt, segments in examples:
        seq = tokenizer(prompt, add_special_tokens=False).input_ids
        target = [-100] * len(seq)
        for text, trained in segments:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            seq += ids
            target += ids if trained else [-100] * len(ids)
        seqs.append(seq + [tokenizer.eos_token_id])
        targets.append(target + [tokenizer.eos_token_id])
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), width), -100)  # the model shifts labels itself
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (seq, target) in enumerate(zip(seqs, targets)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq)] = torch.tensor(target)
        attention_mask[i, : len(seq)] = 1
    return input_ids, attention_mask, labels


def parse_answer(response: str) -> int | None:
    """The integer after the last ``Answer:``, or None when there is none.

    A local exact grader for the build's own measurement; RL rewards come from ``pace.reward``.
    """
    _, found, tail = response.rpartition(ANSWER_PREFIX.strip())
    if not found:
        return None
    match = re.fullmatch(r"\s*(-?\d+)\s*", tail)
    return int(match.group(1)) if match else None


@torch.no_grad()
def _measure(model, tokenizer, prompts: list[Prompt], spec: TinySpec, batch: int = 200) -> dict:
    """Sampled accuracy (temperature 1, no top-k/top-p: what RL rollouts see) and lengths."""
    per_level: dict[int, dict[str, list[int]]] = {}
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        enc = tokenizer(
            [p.text for p in chunk], return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        )
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=spec.eval_max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for p, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :].tolist()):
            n = ids.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in ids else len(ids)
            text = tokenizer.decode(ids[:n])
            rec = per_level.setdefault(p.meta["level"], {"correct": [], "length": [], "correct_length": [], "direct": []})
            ok = parse_answer(text) == int(p.answer)
            rec["correct"].append(int(ok))
            rec["direct"].append(int("=" not in text))  # answered at once, no worked step
            rec["length"].append(n)
            if ok:
                rec["correct_length"].append(n)

    def summary(xs: list[int]) -> dict:
        return {"min": min(xs), "mean": round(sum(xs) / len(xs), 1), "max": max(xs)} if xs else {}

    levels = sorted(per_level)
    return {
        "eval_prompts": len(prompts),
        "accuracy_per_level": {lv: round(sum(per_level[lv]["correct"]) / len(per_level[lv]["correct"]), 3) for lv in levels},
        "accuracy_overall": round(sum(sum(r["correct"]) for r in per_level.values()) / len(prompts), 3),
        "direct_rate_per_level": {lv: round(sum(per_level[lv]["direct"]) / len(per_level[lv]["direct"]), 3) for lv in levels},
        "accuracy_direct_per_level": {
            lv: round(sum(c for c, d in zip(per_level[lv]["correct"], per_level[lv]["direct"]) if d)
                      / max(1, sum(per_level[lv]["direct"])), 3) for lv in levels},
        # response tokens without EOS; a response that never stopped counts max_new_tokens
        "response_tokens_per_level": {lv: summary(per_level[lv]["length"]) for lv in levels},
        "correct_response_tokens_per_level": {lv: summary(per_level[lv]["correct_length"]) for lv in levels},
        "truncated_per_level": {
            lv: sum(n >= spec.eval_max_new_tokens for n in per_level[lv]["length"]) for lv in levels
        },
    }


@torch.no_grad()
def _generate(model, tokenizer, texts: list[str], max_new_tokens: int, stop: list[str] | None = None) -> list[str]:
    """Sampled continuations (temperature 1), each cut after EOS or a stop string (kept)."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         stop_strings=stop, tokenizer=tokenizer if stop else None)
    texts = []
    for ids in out[:, enc["input_ids"].shape[1]:].tolist():
        n = ids.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in ids else len(ids)
        text = tokenizer.decode(ids[:n])
        for s in stop or []:
            if s in text:
                text = text[: text.index(s) + len(s)]
        texts.append(text)
    return texts


def _measure_tool(model, tokenizer, prompts: list[Prompt], spec: TinySpec, batch: int = 200) -> dict:
    """The tool model's sampled behaviour with real tool calls: it generates until `</code>` or EOS,
    a program runs in the sandbox (bubblewrap when installed) and the model continues after the
    interpreter text, once. Per level: accuracy, the tool-use rate, accuracy with and without it."""
    from pace.tools.protocol import CODE_STOP, extract_code, format_output
    from pace.tools.sandbox import Sandbox

    per_level: dict[int, dict[str, int]] = {}
    backend = "bwrap" if shutil.which("bwrap") else "process"
    with Sandbox(backend) as sandbox:
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            first = _generate(model, tokenizer, [p.text for p in chunk], spec.eval_max_new_tokens, stop=[CODE_STOP])
            called = [j for j, t in enumerate(first) if t.endswith(CODE_STOP)]
            outputs = [sandbox.run(extract_code(first[j]) or "") for j in called]
            contexts = [chunk[j].text + first[j] + format_output(r.output, 512) for j, r in zip(called, outputs)]
            finals = dict(zip(called, _generate(model, tokenizer, contexts, spec.eval_max_new_tokens))) if called else {}
            for j, p in enumerate(chunk):
                ok = parse_answer(finals.get(j, first[j])) == int(p.answer)
                rec = per_level.setdefault(p.meta["level"], {"n": 0, "correct": 0, "tool": 0, "tool_correct": 0})
                rec["n"] += 1
                rec["correct"] += ok
                rec["tool"] += j in finals
                rec["tool_correct"] += ok and j in finals
    levels = sorted(per_level)
    r = {lv: per_level[lv] for lv in levels}
    return {
        "eval_prompts": len(prompts),
        "sandbox": backend,
        "accuracy_per_level": {lv: round(x["correct"] / x["n"], 3) for lv, x in r.items()},
        "accuracy_overall": round(sum(x["correct"] for x in r.values()) / len(prompts), 3),
        "tool_rate_per_level": {lv: round(x["tool"] / x["n"], 3) for lv, x in r.items()},
        "accuracy_with_tool_per_level": {lv: round(x["tool_correct"] / max(x["tool"], 1), 3) for lv, x in r.items()},
        "accuracy_direct_per_level": {lv: round((x["correct"] - x["tool_correct"]) / max(x["n"] - x["tool"], 1), 3)
                                      for lv, x in r.items()},
    }
