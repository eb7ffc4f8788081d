"""One word per concept: microbatching is called "microbatch" in the package's code.

The retired names (ubatch, DBO, split, cut) must not come back in identifiers: module, class, function,
parameter, attribute and variable names, config fields, keyword arguments, and identifier-like strings
(JSON keys, CLI flags, dict keys). Unrelated splitting stays allowed: `str.split`, `torch.split`,
`.rsplit`, `.splitlines`, `split_qkv`, a local callable named `split`. Only the old CLI flags, kept
as aliases, are allowed, and each allowed entry must still be in use (the list cannot rot).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import engram_serve

PACKAGE = Path(engram_serve.__file__).resolve().parent

# on an identifier in snake_case (camelCase is converted first): whole words, or the retired compounds
RETIRED = re.compile(r"(?:^|_)(?:ubatch(?:es)?|dbo|cuts?)(?:_|$)"
                     r"|split_config|plan_split|split_batch|num_splits|split_threshold|split_steps|unsplit")
# the old CLI flags, kept as aliases of --microbatches and --microbatch-threshold
ALLOWED = {("cli.py", "--ubatches"), ("cli.py", "--split-threshold"), ("server/run.py", "--ubatches")}
IDENTIFIER_LIKE = re.compile(r"-{0,2}[A-Za-z_][A-Za-z0-9_-]*")
SETTING = "split (as a setting)"


def snake(name: str) -> str:
    """'UbatchBuffers' -> 'ubatch_buffers', 'DBOConfig' -> 'dbo_config', '--split-threshold' -> 'split_threshold'."""
    name = name.lstrip("-").replace("-", "_")
    words = [w for part in name.split("_") for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", part)]
    return "_".join(w.lower() for w in words)


def retired(name: str) -> bool:
    return bool(RETIRED.search(snake(name)))


def _names(tree: ast.AST):
    """(line, name) of every identifier the source defines or uses, and of identifier-like strings.
    A bare `split` counts where it names a setting: an attribute read without a call (`cfg.split`), a
    keyword argument (`split=`), a parameter or an annotated field; a called `.split(...)` does not."""
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for n in ast.walk(tree):
        line = getattr(n, "lineno", 0)
        if isinstance(n, ast.Name):
            yield line, n.id
        elif isinstance(n, ast.Attribute):
            yield line, n.attr
            if n.attr == "split" and id(n) not in called:
                yield line, SETTING  # `cfg.split`: the setting, not the method
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield line, n.name
        elif isinstance(n, ast.arg):
            yield line, SETTING if n.arg == "split" else n.arg
        elif isinstance(n, ast.keyword) and n.arg is not None:
            yield line, SETTING if n.arg == "split" else n.arg
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == "split":
            yield line, SETTING
        elif isinstance(n, ast.alias):
            yield line, n.name
            if n.asname:
                yield line, n.asname
        elif isinstance(n, ast.ImportFrom) and n.module:
            yield line, n.module
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and IDENTIFIER_LIKE.fullmatch(n.value):
            yield line, n.value


def hits(source: str, where: str = "<snippet>") -> list[str]:
    """'where:line: name' for each retired name in `source`, less the allowed CLI aliases."""
    out = []
    for line, name in _names(ast.parse(source)):
        parts = name.split(".") if "." in name and not name.startswith("-") else [name]
        if (name == SETTING or any(retired(p) for p in parts)) and (where, name) not in ALLOWED:
            out.append(f"{where}:{line}: {name}")
    return out


def package_sources() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_package_uses_one_word_for_microbatching():
    found = [h for where, src in package_sources().items() for h in hits(src, where)]
    found += [f"{where}: module name" for where in package_sources() if retired(Path(where).stem)]
    assert not found, "retired names for microbatching (use 'microbatch'):\n" + "\n".join(found)


def test_every_allowed_alias_is_still_there():
    sources = package_sources()
    for where, name in ALLOWED:
        assert any(n == name for _, n in _names(ast.parse(sources[where]))), f"stale allow-list entry {where}: {name}"


def test_the_check_catches_each_retired_name():
    """Negative control: each old spelling, as code of the kind it used to appear in, is found."""
    old = {
        "from ..inputs.ubatch import SplitConfig": 2,
        "cfg = RunnerConfig(split=SplitConfig(num_ubatches=2))": 3,
        "n = self.cfg.split.num_ubatches": 2,
        "bounds = plan_split(qsl, cfg, False)": 1,
        "parts = split_batch(batch, bounds)": 1,
        "bufs = UbatchBuffers.allocate(cfg, 0, 8)": 1,
        "k = ctx.bufs.ubatch": 1,
        "row = {'dbo_ms': 1.0, 'step_cut': True}": 2,
        "p.add_argument('--ubatches', type=int)": 1,
        "def f(split): return split": 1,
        "class C:\n    split: int = 2": 1,
        "cut_offsets = [1, 2]": 1,
        "num_splits = 3": 1,
        "class DBOConfig: pass": 1,
        "steps = {'split_steps': 1, 'identical_to_unsplit': True}": 2,
    }
    for source, n in old.items():
        assert len(hits(source)) == n, (source, hits(source))


def test_unrelated_splitting_is_allowed():
    fine = ("words = 'a b'.split()", "parts = torch.split(x, 2)", "a, b = line.rsplit(':', 1)",
            "lines = text.splitlines()", "q, k, v = self.split_qkv(x)", "for parts, split in names: split(x)",
            "from jinja2.sandbox import ImmutableSandboxedEnvironment", "bounds = plan_microbatches(qsl, cfg)",
            "p.add_argument('--microbatches', '--ubatches', dest='microbatches')")
    for source in fine:
        found = [h for h in hits(source) if "--ubatches" not in h]
        assert not found, (source, found)
