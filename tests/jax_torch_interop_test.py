"""One process, both frameworks: after JAX has launched the kernels, torch still launches them
correctly, and the two frontends give the same numbers (the same kernel objects run both).

Both paths, each on explicit devices: CPU (torch CPU tensors and JAX CPU arrays under
``SPARSETP_INTERPRET=1``: the kernels in Triton's interpreter, where the two frontends agree
bitwise; without it CPU data takes each framework's native path) always, and CUDA (compiled kernels:
torch on ``cuda``, JAX on its first GPU, both held to the oracle's tolerance and to each other's)
when torch and JAX both see a GPU; the CUDA case is skipped, saying so, without one.

Also checks the jax-triton import side effect fix: jax-triton 0.3.1 sets
``TRITON_CACHE_DIR=""`` for the whole process at import, after which torch's compiled launches
fail; :func:`sparsetp.backends.jax.compat.jax_triton` restores the variable. jax-triton cannot be
imported on a CPU-only JAX, so that test imports a stand-in package with 0.3.1's side effect.
"""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import unittest
import warnings
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))
from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import testing_utils as tu  # noqa: E402
import torch  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from sparsetp.backends.jax import attention as jattn  # noqa: E402
from sparsetp.backends.jax import compat  # noqa: E402
from sparsetp.backends.torch import attention as tattn  # noqa: E402
from sparsetp.core import make_layout, reference  # noqa: E402
from sparsetp.core.examples import example_pattern  # noqa: E402


def _devices(platform: str):
    """(torch device, JAX device) of ``platform`` ("cpu" or "cuda"); skips the test when the
    CUDA pair is not there."""
    if platform == "cpu":
        return torch.device("cpu"), jax.devices("cpu")[0]
    try:
        jax_gpus = jax.devices("gpu")
    except RuntimeError:
        jax_gpus = []
    if not torch.cuda.is_available() or not jax_gpus:
        raise unittest.SkipTest(f"needs a CUDA GPU seen by torch and by JAX (torch sees "
                                f"{torch.cuda.device_count()}, JAX {len(jax_gpus)})")
    return torch.device("cuda", 0), jax_gpus[0]


def _case(seed=0):
    n, bs, h = 100, 32, 3
    layout = make_layout(example_pattern("per_head_mix", n, bs), n, h, bs)
    q, k, v, d_out = tu.random_inputs(seed, (2, h, n, 32), "float32")
    return layout, q, k, v, d_out


def _jax_run(layout, q, k, v, d_out, device):
    q, k, v, d_out = (jax.device_put(a, device) for a in (q, k, v, d_out))
    (out, lse), vjp = jax.vjp(lambda q, k, v: jattn.sparse_attention(
        q, k, v, layout, return_lse=True), q, k, v)
    assert out.devices() == {device}, out.devices()
    grads = vjp((d_out, jax.numpy.zeros(lse.shape, lse.dtype, device=device)))
    return [np.asarray(a) for a in (out, lse, *grads)]


def _torch_run(layout, q, k, v, d_out, device):
    tq, tk, tv = (torch.from_numpy(x).to(device).requires_grad_(True) for x in (q, k, v))
    out, lse = tattn.sparse_attention(tq, tk, tv, layout, return_lse=True)
    assert out.device == device, out.device
    out.backward(torch.from_numpy(d_out).to(device))
    return [t.detach().cpu().numpy() for t in (out, lse, tq.grad, tk.grad, tv.grad)]


class InteropTest(parameterized.TestCase):
    @parameterized.parameters("cpu", "cuda")
    def test_torch_after_jax_same_numbers(self, platform):
        torch_dev, jax_dev = _devices(platform)
        if platform == "cpu":
            self.enter_context(mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}))
        layout, q, k, v, d_out = _case()
        cache_dir = os.environ.get("TRITON_CACHE_DIR")
        jax_res = _jax_run(layout, q, k, v, d_out, jax_dev)
        self.assertEqual(os.environ.get("TRITON_CACHE_DIR"), cache_dir)
        torch_res = _torch_run(layout, q, k, v, d_out, torch_dev)
        ref_out, ref_lse = reference.attention(q, k, v, layout)
        refs = [ref_out, ref_lse, *reference.attention_grad(q, k, v, layout, d_out)]
        names = ("out", "lse", "dq", "dk", "dv")
        for name, a, r in zip(names, torch_res, refs, strict=True):
            tu.assert_close(a, r, "float32", grad=name.startswith("d"), what=f"torch {name}")
        if platform == "cpu":
            # Same kernels, same inputs, same (interpreted) arithmetic: bitwise equal.
            for name, a, b in zip(names, jax_res, torch_res, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"jax vs torch {name}")
        else:
            # Compiled: each frontend launches the same kernels, but not necessarily with the
            # same schedule of blocks (GPU parity runs saw some results bitwise, not all).
            for name, a, r in zip(names, jax_res, refs, strict=True):
                tu.assert_close(a, r, "float32", grad=name.startswith("d"), what=f"jax {name}")
            for name, a, b in zip(names, jax_res, torch_res, strict=True):
                tu.assert_close(a, b, "float32", grad=name.startswith("d"),
                                what=f"jax vs torch {name}")
        # And JAX again after torch: bitwise what it gave before (same device, same launch).
        for name, a, b in zip(names, _jax_run(layout, q, k, v, d_out, jax_dev), jax_res,
                              strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"jax after torch {name}")

    def test_jax_triton_import_restores_triton_cache_dir(self):
        with tempfile.TemporaryDirectory() as tmp:
            pkg = os.path.join(tmp, "jax_triton")
            os.makedirs(pkg)
            with open(os.path.join(pkg, "__init__.py"), "w") as f:
                f.write(textwrap.dedent("""\
                    # Stand-in with jax-triton 0.3.1's import-time side effect.
                    import os
                    os.environ["TRITON_CACHE_DIR"] = ""
                    __version__ = "0.3.1"
                    def triton_call(*args, **kwargs):
                        raise AssertionError("stand-in: never launched")
                    """))
            saved_env = os.environ.get("TRITON_CACHE_DIR")
            saved_mod = compat._JAX_TRITON
            sys.path.insert(0, tmp)
            try:
                for value in ("/tmp/sparsetp-triton-cache", None):
                    sys.modules.pop("jax_triton", None)
                    compat._JAX_TRITON = None
                    if value is None:
                        os.environ.pop("TRITON_CACHE_DIR", None)
                    else:
                        os.environ["TRITON_CACHE_DIR"] = value
                    with warnings.catch_warnings():
                        warnings.simplefilter("error")  # the tested version: no warning
                        module = compat.jax_triton()
                    self.assertEqual(module.__file__, os.path.join(pkg, "__init__.py"))
                    self.assertEqual(os.environ.get("TRITON_CACHE_DIR"), value)
                # Another version: imported, with a warning that it is untested.
                sys.modules.pop("jax_triton", None)
                compat._JAX_TRITON = None
                with mock.patch.object(compat, "TESTED_JAX_TRITON", ("9.9.9",)):
                    with self.assertWarnsRegex(UserWarning, "jax_triton 0.3.1 is untested"):
                        compat.jax_triton()
                # torch still launches (and gets the right numbers) afterwards: compiled on a
                # GPU (where an empty TRITON_CACHE_DIR breaks launches), else interpreted.
                device = torch.device("cuda", 0) if torch.cuda.is_available() else \
                    torch.device("cpu")
                layout, q, k, v, d_out = _case(seed=1)
                out = _torch_run(layout, q, k, v, d_out, device)[0]
                tu.assert_close(out, reference.attention(q, k, v, layout)[0], "float32",
                                what="torch out after the jax_triton import")
            finally:
                sys.path.remove(tmp)
                sys.modules.pop("jax_triton", None)
                compat._JAX_TRITON = saved_mod
                if saved_env is None:
                    os.environ.pop("TRITON_CACHE_DIR", None)
                else:
                    os.environ["TRITON_CACHE_DIR"] = saved_env


if __name__ == "__main__":
    absltest.main()
