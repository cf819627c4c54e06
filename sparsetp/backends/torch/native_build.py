"""Builds ``native.cpp`` into one file of the cache, run as its own process by
:mod:`sparsetp.backends.torch.native` (``python native_build.py SOURCE TARGET CFLAGS...``).

Why a process of its own: a build thread in the user's process imports torch's C++ toolchain
(setuptools among it) while the user's calls run, and their Python then waits on the GIL: the
first second of backwards ran 2-15x slower (``benchmarks/KERNEL_NOTES.md``, "Session 30").
This script imports nothing of sparsetp (a plain script, not ``-m``): only torch's
``cpp_extension``, in this process.

Why not ``cpp_extension``'s own build directory: its lock file stays behind when a build is
killed (a short script that exits mid-build, a Ctrl-C), and every later build on the machine
then waits for it forever. Here builders take an ``flock`` on ``TARGET.lock`` (released by the
kernel when its holder dies), build in a fresh directory and rename the library into ``TARGET``
(atomic: a reader sees a whole file or none). A build that outlives the process that started
it still finishes the cache for the next one.

Prints ``TARGET`` on success; on failure exits 1 with a JSON line ``{"type", "message"}`` last
on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

try:
    import fcntl
except ImportError:  # not POSIX: builders may race, each renaming a whole file into place
    fcntl = None

NAME = "sparsetp_native"  # the module name compiled into the library (PyInit_sparsetp_native)


def _build_prefix(target: str) -> str:
    return f".build-{os.path.basename(target)}-"


def _compile(source: str, target: str, cflags: list[str]) -> None:
    from torch.utils import cpp_extension  # noqa: PLC0415 (only this process pays the import)

    with tempfile.TemporaryDirectory(prefix=_build_prefix(target),
                                     dir=os.path.dirname(target)) as build:
        module = cpp_extension.load(name=NAME, sources=[source], extra_cflags=cflags,
                                    build_directory=build, verbose=False)
        os.replace(module.__file__, target)


def build(source: str, target: str, cflags: list[str]) -> None:
    """Make ``target`` exist: build it, or wait for the builder that holds its lock."""
    if os.path.exists(target):
        return
    with open(target + ".lock", "w") as lock:
        if fcntl is not None:  # the kernel drops the lock when its holder dies, even killed
            fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(target):  # the holder we waited for built it
            return
        cache = os.path.dirname(target)
        for name in os.listdir(cache):  # what builders killed mid-build left behind
            if name.startswith(_build_prefix(target)):
                shutil.rmtree(os.path.join(cache, name), ignore_errors=True)
        _compile(source, target, cflags)


def main(argv: list[str]) -> int:
    source, target, *cflags = argv
    try:
        build(source, target, cflags)
    except Exception as exc:  # noqa: BLE001 (reported to the starting process, which warns)
        sys.stderr.write("\n" + json.dumps({"type": type(exc).__name__, "message": str(exc)})
                         + "\n")
        return 1
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
