"""Declared versions are tested versions: the installed packages fall in pyproject's ranges.

The test also prints them (``pytest -s`` or the report header shows the same line), so every
suite run, on CPU or on the GPU machine, records what it ran with.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re

import tomllib
from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: ``"2.11.0+cu130"`` -> ``(2, 11, 0)``."""
    return tuple(int(x) for x in re.match(r"\d+(?:\.\d+)*", text).group(0).split("."))


def _requirements() -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    with open(os.path.join(_ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += [r for r in extra if not r.startswith("sparsetp")]
    out: dict = {}
    for req in reqs:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", req).groups()
        out.setdefault(name.lower(), []).extend(
            (op, _version(v)) for op, v in re.findall(r"(>=|<=|==|<|>)\s*([\d.]+)", spec))
    return out


def _ok(installed: tuple[int, ...], op: str, bound: tuple[int, ...]) -> bool:
    width = max(len(installed), len(bound))
    a = installed + (0,) * (width - len(installed))
    b = bound + (0,) * (width - len(bound))
    return {">=": a >= b, "<=": a <= b, "==": a == b, "<": a < b, ">": a > b}[op]


def installed_versions() -> dict[str, str]:
    """Installed versions of the declared packages (and jax-triton, the GPU path's import)."""
    out = {}
    for name in (*_requirements(), "jax-triton", "jaxlib"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


class VersionsTest(absltest.TestCase):

    def test_installed_versions_are_declared(self):
        versions = installed_versions()
        print("sparsetp ran with: " + ", ".join(f"{n} {v}" for n, v in sorted(versions.items())))
        for name, bounds in _requirements().items():
            if name not in versions:
                continue  # an optional extra that is not installed here
            for op, bound in bounds:
                self.assertTrue(_ok(_version(versions[name]), op, bound),
                                f"{name} {versions[name]} is outside pyproject's {op} "
                                f"{'.'.join(map(str, bound))}")

    def test_version_parsing(self):
        self.assertEqual(_version("2.11.0+cu130"), (2, 11, 0))
        self.assertTrue(_ok((3, 9, 0), "<", (3, 10)))
        self.assertFalse(_ok((3, 10), "<", (3, 10)))


if __name__ == "__main__":
    absltest.main()
