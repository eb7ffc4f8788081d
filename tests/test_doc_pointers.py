"""A pointer in a docstring, a comment or a doc leads somewhere: the file it names exists, and so does
the function, class or attribute it names.

Where pointers are read:
  - Python (engram_serve/, tests/, scripts/, benchmarks/, setup.py): module, class and function
    docstrings and `#` comments (other string literals are data, not prose);
  - C (`*.c`, `*.h` in engram_serve/): `/* ... */` and `//` comments;
  - docs/*.md and README.md: the whole text.
This file's own docstrings are not read (they quote pointers that lead nowhere on purpose).

What is a pointer (anything else is prose):
  1. A PATH: `folder/.../name.EXT`, EXT one of py, c, h, md, json, with at least one `/`, not part of a
     URL, an absolute path or a `../` path. It is resolved against the package root (engram_serve/), the
     repository root and the referencing file's folder, and must be a file under one of them. It is a
     pointer only when its first folder exists under one of those three: a path into another project
     (mlx-lm's `models/deepseek_v41.py`) or a placeholder (`DIR/config.json`) is not ours to check.
     History may name a file that is gone: a path followed by "(removed in COMMIT)" or ", removed in
     COMMIT" is not checked.
  2. A PATH OF CODE (.py, .c, .h) AND A NAME, as this codebase writes them: "model/deepseek_v41.py
     `hyper_mix`" (the path, then the name in backticks), "`ModelRunner` (runner/model_runner.py)" (the
     name in backticks, then the path in brackets) and pytest's "tests/test_exact.py::test_name". The
     name, or each part of a dotted one (`MoE.stages`), must be defined in that file: for Python anywhere
     in it (a def, a class, an assignment, a `self.` attribute, a dataclass field or an import, as a grep
     would find them), for C a word of the file.
  3. A DOTTED NAME in backticks, `module.name` (or `module.Class.attr`, `module.name()`): it is a pointer
     when its leading parts name a module: a module's last component (`exactness`), a longer tail of its
     path (`model.exactness`, `engram_serve.model.exactness`), a C extension (its .c file) or a tests/ or
     scripts/ file. A package named by one word alone is not (`engine.abort` is a call on an engine, not
     the package `engram_serve.engine`). The first part after the module must be a submodule or be defined
     in it (for a short name that several modules share, in one of them); `model.safetensors` and other
     spans ending in a file extension are file names, not pointers.

The test lists every dangling pointer as file:line.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "engram_serve"

EXT = r"(?:py|c|h|md|json)"
SEG = r"[A-Za-z0-9_.-]+"
PATH = rf"(?<![\w./~:-])((?:{SEG}/)+[A-Za-z0-9_-]+\.{EXT})(?![\w/])"
CODE = rf"(?<![\w./~:-])((?:{SEG}/)+[A-Za-z0-9_-]+\.(?:py|c|h))(?![\w/])"  # a path that can define a name
IDENT = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
PATH_RE = re.compile(PATH)
REMOVED = re.compile(r"`?\s*[(,]\s*removed in [0-9a-f]{7,40}\b")
PATH_THEN_NAME = re.compile(rf"`?{CODE}`?[ \t]+`({IDENT})(?:\(\))?`")
NAME_THEN_PATH = re.compile(rf"`({IDENT})(?:\(\))?`[ \t]+\(`?{CODE}`?[,;:)\s]")
NODE_ID = re.compile(rf"{CODE}::({IDENT})")
TICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(rf"({IDENT})(?:\(\))?")
FILE_SUFFIXES = {"py", "c", "h", "md", "json", "txt", "safetensors", "so", "png"}


def sources(root: Path) -> list[Path]:
    pkg = root / PACKAGE
    found = [*pkg.rglob("*.py"), *pkg.rglob("*.c"), *pkg.rglob("*.h"), *(root / "tests").rglob("*.py"),
             *(root / "scripts").glob("*.py"), *(root / "benchmarks").glob("*.py"), *(root / "docs").glob("*.md"),
             root / "README.md", root / "setup.py"]
    me = Path(__file__).resolve()
    return sorted(p for p in found if p.is_file() and p.resolve() != me)


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of each docstring and comment of a source, or of a whole doc."""
    text = path.read_text()
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                        and isinstance(first.value.value, str)):
                    yield first.value.lineno, first.value.value
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
    elif path.suffix in (".c", ".h"):
        for m in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.S):
            yield text.count("\n", 0, m.start()) + 1, m.group(0)
    else:
        yield 1, text


class Index:
    """The repository's files, its modules and the names each defines."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, list[Path]] = {}  # every dotted tail of a module's path -> its files
        self.packages: set[str] = set()  # tails that name a package (an __init__)
        for f in sorted((root / PACKAGE).rglob("*.py")) + sorted((root / PACKAGE).rglob("*.c")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
                self.packages.add(parts[-1])
            for i in range(len(parts)):
                self.modules.setdefault(".".join(parts[i:]), []).append(f)
        for folder in ("tests", "scripts"):
            for f in sorted((root / folder).glob("*.py")):
                self.modules.setdefault(f.stem, []).append(f)
                self.modules.setdefault(f"{folder}.{f.stem}", []).append(f)
        self._names: dict[Path, set[str]] = {}

    def names(self, f: Path) -> set[str]:
        if f not in self._names:
            text = f.read_text()
            if f.suffix == ".py":
                out = set()
                for n in ast.walk(ast.parse(text, str(f))):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        out.add(n.name)
                    elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        out.add(n.id)
                    elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                        out.add(n.attr)
                    elif isinstance(n, ast.alias):
                        out.add((n.asname or n.name).split(".")[0])
                self._names[f] = out
            else:
                self._names[f] = set(re.findall(r"[A-Za-z_]\w*", text))
        return self._names[f]

    def resolve(self, ref: str, source: Path) -> Path | None:
        for base in (self.root / PACKAGE, self.root, source.parent):
            if (base / ref).is_file():
                return base / ref
        return None

    def ours(self, ref: str, source: Path) -> bool:
        first = ref.split("/")[0]
        return any((base / first).is_dir() for base in (self.root / PACKAGE, self.root, source.parent))

    def defines(self, f: Path, dotted: str) -> bool:
        return all(part in self.names(f) for part in dotted.split("."))

    def dotted_dangles(self, span: str) -> bool:
        """True when `span` is a module.name pointer (rule 3) whose name is not in the module."""
        parts = span.split(".")
        if parts[-1] in FILE_SUFFIXES:
            return False
        for k in range(len(parts), 0, -1):
            key = ".".join(parts[:k])
            if key in self.modules and not (k == 1 and key in self.packages):
                break
        else:
            return False
        if k == len(parts) or ".".join(parts[:k + 1]) in self.modules:
            return False  # the span names a module, or a submodule of one
        return not any(parts[k] in self.names(f) for f in self.modules[key])


def dangling(root: Path, files: list[Path] | None = None) -> list[str]:
    """'file:line: pointer (why)' for every pointer that leads nowhere."""
    index = Index(root)
    out = []
    for src in files if files is not None else sources(root):
        rel = src.relative_to(root).as_posix()
        for line, text in prose(src):
            def at(pos: int) -> str:
                return f"{rel}:{line + text.count(chr(10), 0, pos)}"
            for m in PATH_RE.finditer(text):
                ref = m.group(1)
                if (index.ours(ref, src) and index.resolve(ref, src) is None
                        and not REMOVED.match(text, m.end())):
                    out.append(f"{at(m.start())}: {ref} (no such file)")
            pairs = [(m, m.group(1), m.group(2)) for m in PATH_THEN_NAME.finditer(text)]
            pairs += [(m, m.group(1), m.group(2)) for m in NODE_ID.finditer(text)]
            pairs += [(m, m.group(2), m.group(1)) for m in NAME_THEN_PATH.finditer(text)]
            for m, ref, name in pairs:
                f = index.resolve(ref, src)
                if f is not None and not index.defines(f, name):
                    out.append(f"{at(m.start())}: {ref} `{name}` (not defined there)")
            for m in TICKED.finditer(text):
                d = DOTTED.fullmatch(m.group(1))
                if d and "." in d.group(1) and index.dotted_dangles(d.group(1)):
                    out.append(f"{at(m.start())}: `{d.group(1)}` (no such name in the module)")
    return out


def test_every_pointer_in_docstrings_comments_and_docs_leads_somewhere():
    found = dangling(ROOT)
    assert not found, "pointers that lead nowhere:\n" + "\n".join(found)


def test_the_checker_reads_the_pointers_the_codebase_writes():
    """Real pointers of each kind are read and resolved: changing one character of each makes it dangle."""
    index = Index(ROOT)
    src = ROOT / PACKAGE / "model" / "loader.py"
    assert index.resolve("model/paged_state.py", src) and index.resolve("docs/contract.md", src)
    assert index.resolve("checkpoint.py", src)  # the referencing file's folder
    assert index.resolve("model/_kernel_math.h", src) and index.resolve("tests/reference/reference_v41.py", src)
    assert index.defines(index.resolve("model/deepseek_v41.py", src), "MoE.stages")
    assert not index.defines(index.resolve("model/deepseek_v41.py", src), "MoE.stage")
    assert not index.dotted_dangles("exactness.pointwise") and index.dotted_dangles("exactness.pointwiser")
    assert not index.dotted_dangles("engine.abort")  # a variable named like a package: prose
    assert not index.dotted_dangles("model.safetensors") and not index.dotted_dangles("torch.split")


def test_negative_control_a_docstring_naming_a_missing_module_is_reported(tmp_path):
    """A synthetic repository whose module docstring, comments and doc point at a missing module, a
    missing function and a missing file: each is reported with its file and line; the pointers that
    exist, a history entry and another project's path are not."""
    (tmp_path / PACKAGE / "model").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / PACKAGE / "model" / "real.py").write_text("def here():\n    pass\n")
    mod = tmp_path / PACKAGE / "model" / "user.py"
    mod.write_text('"""Uses model/real.py `here`, and `EngramModel.stages` (model/model.py).\n\n'
                   'See `real.gone` and model/real.py `missing`; old: model/old.c (removed in 9d33789);\n'
                   "mlx-lm's models/deepseek_v41.py.\"\"\"\n# see model/nowhere.py\n")
    doc = tmp_path / "docs" / "a.md"
    doc.write_text("Intro.\n\nThe kernel: `engram_serve/model/real.py::here`, `engram_serve/model/gone.c`.\n")
    found = dangling(tmp_path, [mod, doc])
    assert found == [
        f"{PACKAGE}/model/user.py:1: model/model.py (no such file)",
        f"{PACKAGE}/model/user.py:3: model/real.py `missing` (not defined there)",
        f"{PACKAGE}/model/user.py:3: `real.gone` (no such name in the module)",
        f"{PACKAGE}/model/user.py:5: model/nowhere.py (no such file)",
        "docs/a.md:3: engram_serve/model/gone.c (no such file)",
    ], found
