"""Make pyzmq and msgspec importable on a machine that lacks them, offline.

The GPU machines come with torch, cuda-bindings and the test tools but not
these two, and have no network; ``make gpu-wheels`` fetches their wheels
here, and the kit installs them into a folder of the carried wheel folder
named after the interpreter (``site-cp312``), never into the image's own
site-packages, so the image's torch stays as it is. pip does the install when
the image has it; a wheel is a zip of an importable tree, so unpacking it is
the fallback where pip is missing.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

NEEDED = ("zmq", "msgspec")


class WheelError(RuntimeError):
    """The modules are missing and the carried wheels cannot provide them."""


def missing() -> list[str]:
    out = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out


def fits(filename: str, version: tuple[int, int] = sys.version_info[:2], machine: str = "x86_64") -> bool:
    """Whether a wheel's tags (name-version-python-abi-platform.whl) suit this interpreter."""
    parts = filename[:-len(".whl")].split("-")
    if len(parts) < 5:
        return False
    python, abi, plat = parts[-3], parts[-2], parts[-1]
    if machine not in plat and plat != "any":
        return False
    mine = f"cp{version[0]}{version[1]}"
    if mine in python.split("."):
        return True
    if abi == "abi3":  # stable ABI: built for cp3X, good for every later 3.Y
        return any(p.startswith("cp3") and p[3:].isdigit() and int(p[3:]) <= version[1] for p in python.split("."))
    return python.startswith("py3") and abi == "none"


def ensure(wheel_dir: Path) -> tuple[Path | None, list[str]]:
    """Install the carried wheels if the modules are missing; returns the folder to
    put on ``sys.path``/``PYTHONPATH`` (None when nothing was needed) and notes."""
    absent = missing()
    if not absent:
        return None, []
    import platform

    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    wheels = [w for w in sorted(wheel_dir.glob("*.whl")) if fits(w.name, machine=platform.machine())]
    if not wheels:
        raise WheelError(
            f"{', '.join(absent)} not importable and no {tag} {platform.machine()} wheels in {wheel_dir}: run "
            "`make gpu-wheels` on a machine with network and carry that folder")
    site = wheel_dir / f"site-{tag}"
    stamp = site / ".installed"
    names = "\n".join(w.name for w in wheels)
    notes = []
    if not (stamp.exists() and stamp.read_text() == names):
        site.mkdir(parents=True, exist_ok=True)
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              "--no-index", "--no-deps", "--upgrade", "--target", str(site), *map(str, wheels)],
                             capture_output=True, text=True)
        if pip.returncode == 0:
            notes.append(f"installed {len(wheels)} wheel(s) into {site} with pip")
        else:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(site)
            notes.append(f"unpacked {len(wheels)} wheel(s) into {site} (pip: {pip.stderr.strip()[-200:]})")
        stamp.write_text(names)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    still = missing()
    if still:
        raise WheelError(f"{', '.join(still)} still not importable after installing into {site}")
    return site, notes
