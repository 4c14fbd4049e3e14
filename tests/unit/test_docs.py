"""The documentation cannot rot silently: every command in a code block of README.md and docs/*.md
that names this project's entry points is checked against the code, and every config key and
file the text names exists, and every link between the pages resolves.

- `python train.py …`, `accelerate launch … train.py …`, `torchrun … train.py …`, `python eval.py …`,
  `python simulate.py …`: the Hydra overrides compose on the real conf/ (for a sweep, `a=1,2` is
  composed with its first value), so a renamed key or preset fails here;
- `python scripts/x.py --flag`, `python -m pkg.module --flag`, `bash scripts/x.sh`: the file exists
  and each `--flag` appears in its source;
- `group.key` in backquotes (a top-level group of the schema: `rollout.engine_timeout_s`,
  `pace.gamma`): the key exists in the composed default config;
- a backquoted path with a file suffix (`analysis/claims.py`): the file exists;
- a relative link (`[lab](docs/lab.md#claims)`, an image): its file exists and so does the heading
  its anchor names (GitHub's anchors).
"""
from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pace.config import register
from pace.sim.config import register as register_sim

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
CONFIG_OF = {"train.py": "config", "eval.py": "evaluate", "simulate.py": "simulate"}
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|…")

register()
register_sim()  # simulate.py's schema


def _blocks(path: Path) -> list[str]:
    return re.findall(r"^```(?:bash|sh|shell|console)?\n(.*?)^```", path.read_text(), re.S | re.M)


def commands(path: Path) -> list[str]:
    """Shell lines of a page's code blocks: continuations joined, comments and env prefixes dropped."""
    out = []
    for block in _blocks(path):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if not line or line.startswith("#") or any(ch in line for ch in "─►│"):  # comments, diagrams
                continue
            line = re.sub(r"<[^>]*>", "<x>", line)  # a placeholder (`<checkpoint dir>`) is one word
            try:
                words = shlex.split(line)
            except ValueError:
                continue
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
                words.pop(0)
            if words:
                out.append(words)
    return out


def _entry(words: list[str]) -> tuple[str, list[str]] | None:
    """(entry point, its arguments) of a project command, or None."""
    for i, w in enumerate(words):
        name = Path(w).name
        if name in CONFIG_OF and (i == 0 or words[0] in ("python", "accelerate", "torchrun", "srun")):
            return name, words[i + 1:]
        if words[0] in ("python", "bash", "sbatch", "srun") and (w.startswith("scripts/") or w.endswith((".py", ".sh"))):
            return w, words[i + 1:]
        if words[0] == "python" and w == "-m" and i + 1 < len(words):
            return words[i + 1], words[i + 2:]
    return None


def _cases():
    for page in DOCS:
        for words in commands(page):
            got = _entry(words)
            if got is not None:
                yield pytest.param(page.name, *got, id=f"{page.name}: {' '.join(words)[:90]}")


def _compose(config: str, args: list[str]):
    overrides = []
    for a in args:
        if a in ("-m", "--multirun") or a.startswith(("hydra.", "-")) or PLACEHOLDER.search(a) or "=" not in a:
            continue
        key, _, value = a.partition("=")
        if "," in value and not value.startswith("["):  # a sweep: its first value
            value = value.split(",")[0]
        overrides.append(f"{key}={value}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name=config, overrides=overrides)
    OmegaConf.to_container(cfg, resolve=False)  # every key typed by the schema
    return cfg


@pytest.mark.parametrize("page, entry, args", list(_cases()))
def test_a_documented_command_matches_the_code(page, entry, args):
    if entry in CONFIG_OF:
        _compose(CONFIG_OF[entry], args)
        return
    if entry.endswith((".py", ".sh")) or "/" in entry:
        source = ROOT / entry
    else:  # a module
        module = ROOT / Path(*entry.split("."))
        source = module.with_suffix(".py") if module.with_suffix(".py").exists() else module / "__main__.py"
        if not source.exists() and not entry.startswith(("pace", "analysis", "scripts", "tests")):
            pytest.skip(f"{entry}: not this project's module")
    assert source.exists(), f"{page}: {entry} does not exist"
    text = source.read_text()
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{flag}"' in text or f"'{flag}'" in text or f"{flag} " in text or f"{flag})" in text, \
            f"{page}: {entry} has no option {flag}"


def _default_config():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config")


# dotted names the docs use that are not config keys: run statistics (summary.json's `rollout`), a
# method, a tensor, and a key the docs mention as removed
NOT_CONFIG = {"pool.form_batch", "rollout.resumed_groups", "rollout.orphaned_responses", "rollout.versions_checked",
              "model.embed_tokens.weight", "algo.is_cap"}
FILE_SUFFIXES = (".py", ".json", ".jsonl", ".yaml", ".md", ".parquet", ".safetensors", ".txt", ".log")
KEY = re.compile(r"`([a-z_]+(?:\.[a-z0-9_]+)+)(?:=[^`]*)?`")
PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|yaml|md|json|txt))`")


def test_every_config_key_and_file_the_docs_name_exists():
    cfg = _default_config()
    groups = set(cfg.keys())
    missing = []
    for page in DOCS:
        text = page.read_text()
        for key in KEY.findall(text):
            parts = key.split(".")
            module = parts[0] == "pace" and ((ROOT / "pace" / parts[1]).is_dir() or (ROOT / "pace" / f"{parts[1]}.py").exists())
            if key in NOT_CONFIG or key.endswith(FILE_SUFFIXES) or module or parts[0] not in groups:
                continue
            if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
                missing.append(f"{page.name}: config key {key}")
        for rel in PATH.findall(text):
            outside = rel.startswith(("../", "/")) or not (ROOT / rel.split("/")[0]).exists()  # not this repository's
            if not outside and not rel.startswith(("runs/", "data/")) and not (ROOT / rel).exists():
                missing.append(f"{page.name}: file {rel}")
    assert not missing, "\n".join(missing)


def test_the_config_reference_is_the_schema():
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    assert (ROOT / "docs" / "config-reference.md").read_text() == ref.render(), \
        "docs/config-reference.md is out of date: python scripts/config_reference.py"


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(path: Path) -> str:
    """A page without its code blocks (no links or headings there)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


@functools.cache
def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#{1,6} +(.+?) *#*$", _prose(path), re.M)}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in DOCS:
        for target in (a or b for a, b in LINK.findall(_prose(page))):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            rel, _, frag = target.partition("#")
            dest = (page.parent / rel).resolve() if rel else page
            if rel and not dest.is_relative_to(ROOT):
                continue  # outside this repository (the project's shared folder)
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{frag} in {dest.name})")
    assert not broken, "\n".join(broken)


def test_the_architecture_pages_layout_names_every_module():
    """docs/architecture.md's package layout lists every module of pace/ (by its path, or by its
    file name in a row that starts with its folder's first module)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## Package layout"):]
    modules = sorted(p.relative_to(ROOT) for p in (ROOT / "pace").rglob("*.py") if p.name != "__init__.py")
    missing = [str(m) for m in modules if f"`{m}`" not in table and f"`{m.name}`" not in table]
    assert not missing, f"docs/architecture.md's package layout does not name: {missing}"
