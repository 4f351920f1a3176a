"""What the deployment tests share: where the files are, and a YAML loader."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DAEMON_DIR = ROOT / "daemon"
README = DAEMON_DIR / "README.md"
DOCKERFILE = DAEMON_DIR / "Dockerfile"
DAEMONSET = DAEMON_DIR / "kubernetes" / "daemonset.yaml"


def load_documents(path: pathlib.Path) -> dict[str, dict]:
    """kind -> document, for a YAML file of documents of distinct kinds."""
    yaml = pytest.importorskip(
        "yaml", reason="PyYAML is not installed: add pyyaml to the test extras in pyproject.toml")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def load_daemonset_documents() -> dict[str, dict]:
    return load_documents(DAEMONSET)


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """target -> [(INSTRUCTION, arguments)], continuation lines joined, with the
    global ARG defaults substituted in FROM."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    args: dict[str, str] = {}
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        rest = rest.strip()
        if instruction == "ARG" and current is None and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        if instruction == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            assert m, f"every FROM needs a target name: {line!r}"
            image = re.sub(r"\$\{(\w+)\}", lambda g: args.get(g.group(1), ""), m.group(1))
            current = stages.setdefault(m.group(2), [])
            current.append(("FROM", image))
            continue
        assert current is not None or instruction == "ARG", f"{instruction} before the first FROM"
        if current is not None:
            current.append((instruction, rest))
    return stages
