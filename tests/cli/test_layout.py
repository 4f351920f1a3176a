"""The layout keeps its promises: no import circles among product modules
(type-only imports count: a type is a dependency all the same); the
layers that docs/architecture.md states ("Source layout, as layers": its
table is read here), so no module imports from a layer it may not, and the
layers marked "I/O: none" import no I/O, thread or device library; the
runtime (``kvelastic``, ``kvelastic_vllm``) apart from the tools
(``kvelastic_tools``): no runtime module imports them, and the runtime's
wheel carries none of them; every link of the README and of docs/ leads to
a file that exists; no runtime module past 600 lines (a file that long
mixes jobs: split it by job); and the project speaks of features, not of
its plan: no "Step N" or issue number in code, tests, tools, CLI help or
docs; no module outside the tier names its disk medium; a slab's phase
and route and a device's page budget have one writer (``daemon/state.py``).

A package's ``__init__`` importing its own submodules is its face, not a
circle: those edges are left out.
"""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNTIME = {"kvelastic": ROOT / "kvelastic", "kvelastic_vllm": ROOT / "patches" / "vllm" / "kvelastic_vllm"}
TOOLS = {"kvelastic_tools": ROOT / "tools" / "kvelastic_tools"}
PACKAGES = {**RUNTIME, **TOOLS}


def modules(packages: dict[str, pathlib.Path] = PACKAGES) -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of ``packages`` (the product's)."""
    found = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Product modules ``name`` imports, anywhere in the file (``TYPE_CHECKING``
    blocks and function bodies included)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:       # ``from a.b import C``: the module a.b
                target = target.rpartition(".")[0]
            if target and target != name and not (is_package and target.startswith(name + ".")):
                out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle_through_a_type_only_import(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (tmp_path / "b.py").write_text("from pkg import a\n")
    (tmp_path / "__init__.py").write_text("from pkg import a, b\n")
    known = {"pkg", "pkg.a", "pkg.b"}
    graph = {"pkg.a": imports_of("pkg.a", tmp_path / "a.py", known),
             "pkg.b": imports_of("pkg.b", tmp_path / "b.py", known),
             "pkg": imports_of("pkg", tmp_path / "__init__.py", known)}
    assert circles(graph) == [["pkg.a", "pkg.b"]]     # the package's face is no circle


def test_no_import_circles_among_product_modules() -> None:
    found = modules()
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    assert len(graph) > 100
    assert circles(graph) == [], "import circles: shared records belong in a module below their users"


def test_no_runtime_module_imports_the_tools() -> None:
    found = modules()
    runtime = modules(RUNTIME)
    assert len(runtime) > 60 and len(found) > len(runtime) + 40
    reaching = {name: sorted(t for t in imports_of(name, path, set(found)) if t.split(".")[0] in TOOLS)
                for name, path in runtime.items()}
    assert {name: tools for name, tools in reaching.items() if tools} == {}


MAX_LINES = 600


def test_no_runtime_module_is_past_600_lines() -> None:
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules(RUNTIME).items()}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
    assert max(lengths.values()) > MAX_LINES // 2          # the count reads real files


PLAN_WORDS = re.compile(r"\bStep \d+[a-z]?\b|\bissues? \d+\b|\(issue\b")


def plan_words(paths: list[pathlib.Path]) -> list[str]:
    """Lines of ``paths`` that name a step of the plan or an issue number."""
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{i}: {line.strip()}"
            for path in paths for i, line in enumerate(path.read_text().splitlines(), 1) if PLAN_WORDS.search(line)]


def test_the_project_names_no_step_or_issue_of_its_plan() -> None:
    paths = [p for folder in ("kvelastic", "patches", "tools", "tests", "docs", "daemon", "grafana")
             for p in sorted((ROOT / folder).rglob("*")) if p.suffix in {".py", ".md", ".toml", ".json", ".yml"}]
    paths.append(ROOT / "README.md")
    this = pathlib.Path(__file__).resolve()
    assert len(paths) > 100 and plan_words([p for p in paths if p != this]) == []
    help_text = subprocess.run([sys.executable, "-m", "kvelastic", "--help"], capture_output=True, text=True).stdout
    assert "usage" in help_text and not PLAN_WORDS.search(help_text)


def test_the_plan_word_check_finds_a_step_and_an_issue(tmp_path: pathlib.Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text('"""The keeper (Step 20)."""\nx = 1  # issue 44: lent\nstep = 3  # a Step in the loop\n')
    assert [line.split(": ", 1)[1] for line in plan_words([sample])] == ['"""The keeper (Step 20)."""',
                                                                          "x = 1  # issue 44: lent"]


def test_no_module_outside_the_tier_names_a_medium() -> None:
    """The daemon holds a ``TierStore`` (``tier/store.py``); the medium is
    chosen in ``tier/media.py`` alone, so a second one lands in the tier."""
    names = re.compile(r"\bDiskStore\b|kvelastic\.tier\.disk\b")
    outside = [f"{name}:{i}" for name, path in modules(PACKAGES).items() if not name.startswith("kvelastic.tier")
               for i, line in enumerate(path.read_text().splitlines(), 1) if names.search(line)]
    inside = [name for name, path in modules(RUNTIME).items() if name.startswith("kvelastic.tier.")
              and names.search(path.read_text())]
    assert outside == [] and "kvelastic.tier.media" in inside


# What several parts of the daemon read but one module writes: a slab's phase
# and route (where its cached blocks go), a device's page budget counters, an
# engine's activity, starvation and silence. ``daemon/state.py`` defines the
# records and their transitions (each checks where it may come from);
# everyone else calls those.
ONE_WRITER = {"phase", "route", "created", "creating", "adopted", "held_lent", "creation_failed_at",
              "active_at", "starved_since", "last_unmet", "unresponsive"}
WRITER = "kvelastic.daemon.state"


def writes_of(tree: ast.AST, fields: set[str]) -> list[tuple[int, str]]:
    """(line, field) of every assignment to ``x.field`` in ``tree``."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and t.attr in fields and isinstance(t.ctx, ast.Store):
                    out.append((t.lineno, t.attr))
    return out


# Records of their own with a field of the same name (the client's reserve: its engine's activity).
OWN_RECORDS = {"kvelastic.client.reserve": {"active_at"}}


def test_a_slabs_phase_and_route_and_the_budget_have_one_writer() -> None:
    found = {name: [(line, f) for line, f in writes_of(ast.parse(path.read_text()), ONE_WRITER)
                    if f not in OWN_RECORDS.get(name, set())] for name, path in modules(PACKAGES).items()}
    assert {name: w for name, w in found.items() if w and name != WRITER} == {}
    assert {field for _, field in found[WRITER]} == ONE_WRITER      # the check reads real writes


def test_the_one_writer_check_finds_a_write() -> None:
    tree = ast.parse("slab.route = r\npool.created += 1\nslab.route.way == x\na, b.phase = 1, 2\n")
    assert writes_of(tree, ONE_WRITER) == [(1, "route"), (2, "created"), (4, "phase")]


def test_the_runtimes_wheels_carry_no_tool(tmp_path: pathlib.Path) -> None:
    """The wheels a node installs (the daemon's, the plugin's), built from
    their ``pyproject.toml``: no simulator, benchmark, fuzzer or GPU kit."""
    for project, package in ((ROOT, "kvelastic"), (ROOT / "patches" / "vllm", "kvelastic_vllm")):
        source, out = tmp_path / package / "source", tmp_path / package / "wheel"   # setuptools builds in place
        shutil.copytree(project, source, ignore=lambda folder, names: [
            n for n in names if n in {"__pycache__", "build", "tests", "docs", "tools", "patches", "grafana"}
            or n.endswith(".egg-info") or n.startswith(".")])
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                               "--disable-pip-version-check", "-w", str(out), str(source)],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        [wheel] = out.glob("*.whl")
        names = zipfile.ZipFile(wheel).namelist()
        code = [n for n in names if n.endswith(".py")]
        assert code and all(n.split("/")[0] in RUNTIME for n in code), names
        tools = [n for n in code if re.search(r"(^|/)(sim|bench|vllm_bench|gpucheck|fuzz\w*)(/|\.py$)", n)]
        assert tools == [], tools
        assert len(code) == len(modules({n.split("/")[0]: RUNTIME[n.split("/")[0]] for n in code}))


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_and_docs_links_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    readme_links = LINK.findall((ROOT / "README.md").read_text())
    assert not [t for t in readme_links if re.match(r"https?:", t)], "the README never points outside the repository"
    assert "docs/architecture.md" in readme_links


# ------------------------------------------------------------------ the layers
# The rules are docs/architecture.md's, "Source layout, as layers": a module
# imports only from its own row, the first row, and the paths its "May import"
# cell names; a row marked "I/O: none" imports none of IO_LIBRARIES. A module
# belongs to the row with the longest path that holds it.

ARCHITECTURE = ROOT / "docs" / "architecture.md"
IO_LIBRARIES = {
    "os", "io", "pathlib", "shutil", "tempfile", "socket", "select", "selectors", "signal", "fcntl", "resource",
    "mmap", "ctypes", "threading", "multiprocessing", "concurrent", "subprocess", "asyncio", "http", "urllib",
    "zmq", "prometheus_client", "torch", "cuda", "vllm",
}
TICKED = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Layer:
    paths: tuple[str, ...]          # files, or folders ending in "/", relative to the repository
    may_import: tuple[str, ...]     # the same
    no_io: bool


def _paths(cell: str) -> tuple[str, ...]:
    """The backticked paths of a cell; a name without a folder is in the folder before it."""
    out: list[str] = []
    for token in TICKED.findall(cell):
        if "/" not in token and out:
            token = out[-1].rpartition("/")[0] + "/" + token
        out.append(token)
    return tuple(out)


def layer_table(text: str) -> list[Layer]:
    """The table under a header with "Layer", "May import" and "I/O" columns."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("| Layer |") and "| May import |" in line and line.rstrip().endswith("| I/O |"))
    header = [c.strip() for c in lines[start].strip().strip("|").split("|")]
    at = {name: header.index(name) for name in ("Layer", "May import", "I/O")}
    layers = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(header), line
        assert cells[at["I/O"]] in {"none", "yes"}, line
        layers.append(Layer(_paths(cells[at["Layer"]]), _paths(cells[at["May import"]]), cells[at["I/O"]] == "none"))
    return layers


def _holds(path: str, spec: str) -> bool:
    return path.startswith(spec) if spec.endswith("/") else path == spec


def row_of(layers: list[Layer], path: str) -> int | None:
    """The row whose longest path holds ``path``."""
    best = max(((len(spec), i) for i, layer in enumerate(layers) for spec in layer.paths if _holds(path, spec)),
               default=None)
    return best[1] if best else None


def layer_violations(layers: list[Layer], imports: dict[str, set[str]], libraries: dict[str, set[str]]) -> list[str]:
    """What breaks the table: ``imports`` maps a module's path to the product
    modules' paths it imports, ``libraries`` to the top-level names of the
    others it imports."""
    found = []
    for path in sorted(imports):
        row = row_of(layers, path)
        if row is None:
            found.append(f"{path}: in no row of the table")
            continue
        layer = layers[row]
        for target in sorted(imports[path]):
            face = target.endswith("/__init__.py") and path.startswith(target[:-len("__init__.py")])
            if face or row_of(layers, target) in (row, 0) or any(_holds(target, s) for s in layer.may_import):
                continue
            found.append(f"{path} ({layer.paths[0]}) imports {target}")
        if layer.no_io:
            found += [f"{path} ({layer.paths[0]}, I/O: none) imports {lib}"
                      for lib in sorted(libraries.get(path, set()) & IO_LIBRARIES)]
    return found


def libraries_of(path: pathlib.Path) -> set[str]:
    """Top-level names of the absolute imports in a file, product or not."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_layer_check_finds_what_a_layer_may_not_import() -> None:
    table = layer_table("""
| Layer | What it is | May import | I/O |
|---|---|---|---|
| `pkg/__init__.py` `errors.py` | the bottom | nothing | none |
| `pkg/core/` | pure | nothing | none |
| `pkg/core/journal.py` | a row of its own | `pkg/core/` | none |
| `pkg/daemon/` | the loop | `pkg/core/journal.py` | yes |
""")
    assert table[0].paths == ("pkg/__init__.py", "pkg/errors.py")
    imports = {
        "pkg/core/pool.py": {"pkg/errors.py", "pkg/core/__init__.py", "pkg/daemon/server.py"},
        "pkg/core/journal.py": {"pkg/core/pool.py"},
        "pkg/daemon/server.py": {"pkg/core/journal.py", "pkg/core/pool.py", "pkg/__init__.py"},
        "pkg/tools.py": set(),
    }
    libraries = {"pkg/core/pool.py": {"time", "socket"}, "pkg/daemon/server.py": {"zmq"}}
    assert layer_violations(table, imports, libraries) == [
        "pkg/core/pool.py (pkg/core/) imports pkg/daemon/server.py",
        "pkg/core/pool.py (pkg/core/, I/O: none) imports socket",
        "pkg/daemon/server.py (pkg/daemon/) imports pkg/core/pool.py",
        "pkg/tools.py: in no row of the table",
    ]


def test_every_module_keeps_to_the_layers_architecture_md_states() -> None:
    layers = layer_table(ARCHITECTURE.read_text())
    assert len(layers) > 15
    missing = [spec for layer in layers for spec in (*layer.paths, *layer.may_import) if not (ROOT / spec).exists()]
    assert missing == [], f"docs/architecture.md's layer table names what is not there: {missing}"
    found = modules()
    rel = {name: path.relative_to(ROOT).as_posix() for name, path in found.items()}
    imports = {rel[name]: {rel[t] for t in imports_of(name, path, set(found))} for name, path in found.items()}
    libraries = {rel[name]: libraries_of(path) for name, path in found.items()}
    assert "kvelastic/core/journal.py" in imports["kvelastic/protocol/journal.py"]   # the graph reads real files
    broken = layer_violations(layers, imports, libraries)
    assert not broken, ("imports docs/architecture.md's layers do not allow (its table under 'Source layout, as "
                        "layers'): move the code, or change the table and say why there:\n" + "\n".join(broken))
