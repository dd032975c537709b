"""Compiles the C kernels beside this module for the host's CPU on first use, and loads them with ctypes.

The shared library is cached per source, flags and CPU (its `-march=native` code must never run on
another CPU), under $IPNEXT_KERNEL_CACHE or the user's cache folder, written to a temporary name
and renamed so that concurrent replicas never load half a file; a folder or library that is not
the user's own, or that a group or other users may write, is refused (`check_private`). Where
no compiler is found, the build fails or the cache is refused, `load` returns None once and
logs why, and callers keep the torch reference; IPNEXT_CPU_KERNELS=0 turns the compiled path off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = (
    "-O3",
    "-march=native",
    "-std=c11",
    "-fPIC",
    "-shared",
    "-fopenmp",
    # Let the dot products vectorize (reassociated sums) without giving up infinities, which the
    # online softmax uses as its starting peak.
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
)
COMPILE_TIMEOUT_S = 120
ENABLE_ENV = "IPNEXT_CPU_KERNELS"
CACHE_ENV = "IPNEXT_KERNEL_CACHE"

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """Whether compiled CPU kernels may be used (IPNEXT_CPU_KERNELS is not 0)."""
    return os.environ.get(ENABLE_ENV, "1") != "0"


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ipnext" / "kernels"


def check_private(path: Path) -> None:
    """Refuse a cache folder or library that another user could have written: loading a shared
    library runs its code, so it must be ours and writable by nobody else (a cache folder in a
    shared place, or a $IPNEXT_KERNEL_CACHE pointed at one, is not trusted). Raises
    PermissionError naming the path, its owner and mode, and the fix; `load` then keeps the
    torch reference."""
    found = path.stat()
    if found.st_uid != os.getuid() or found.st_mode & 0o022:
        raise PermissionError(
            f"kernel cache {path}: owned by uid {found.st_uid} with mode {found.st_mode & 0o777:o}; "
            f"a compiled kernel is loaded only from a folder and file owned by this user "
            f"(uid {os.getuid()}) that no group or other user can write. Fix: chmod go-w it, or set "
            f"{CACHE_ENV} to a folder of your own"
        )


def _cpu_identity() -> str:
    """The CPU's model and feature flags: what `-march=native` compiles for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = {line.split(":", 1)[0].strip(): line for line in text.splitlines() if ":" in line}
    return platform.machine() + "\n" + "\n".join(lines.get(key, "") for key in wanted)


def build(source: Path, compiler: str | None = None) -> Path:
    """The cached shared library for `source`, compiled now if it is not there yet.

    Raises RuntimeError naming the compiler's complaint, or FileNotFoundError without a compiler.
    """
    compiler = compiler or os.environ.get("CC") or "cc"
    found = shutil.which(compiler)
    if found is None:
        raise FileNotFoundError(f"no C compiler {compiler!r} on PATH (set CC to one)")
    code = source.read_bytes()
    key = hashlib.sha256(b"\0".join([code, " ".join(FLAGS).encode(), _cpu_identity().encode()]))
    folder = cache_dir()
    target = folder / f"{source.stem}-{key.hexdigest()[:20]}.so"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(folder)
    if target.exists():
        check_private(target)
        return target
    handle, scratch = tempfile.mkstemp(dir=folder, prefix=f".{source.stem}-", suffix=".so")
    os.close(handle)
    try:
        result = subprocess.run(
            [found, *FLAGS, "-o", scratch, str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}: {result.stderr.strip()[-2000:]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


def load(source_name: str) -> ctypes.CDLL | None:
    """The compiled library of the C file `source_name` beside this module, or None (logged once)."""
    if not enabled():
        return None
    with _lock:
        if source_name not in _loaded:
            source = Path(__file__).with_name(source_name)
            try:
                _loaded[source_name] = ctypes.CDLL(str(build(source)))
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:  # PermissionError too
                log.warning("CPU kernel %s not built, using the torch reference: %s", source_name, exc)
                _loaded[source_name] = None
        return _loaded[source_name]
