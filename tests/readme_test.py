"""Every ```python block of README.md runs as written (each in a fresh interpreter). A block whose
first line is ``# torchrun ... --nproc-per-node=N ...`` runs under torchrun with N CPU ranks."""

import os
import re
import subprocess
import sys
import tempfile

from absl.testing import absltest, parameterized

_README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
with open(_README) as f:
    _BLOCKS = re.findall(r"```python\n(.*?)```", f.read(), re.S)


class ReadmeTest(parameterized.TestCase):
    def test_readme_has_examples(self):
        self.assertGreaterEqual(len(_BLOCKS), 3)

    @parameterized.parameters(range(len(_BLOCKS)))
    def test_block_runs(self, i):
        ranks = re.match(r"# torchrun .*--nproc-per-node=(\d+)", _BLOCKS[i])
        if ranks is None:
            proc = subprocess.run([sys.executable, "-c", _BLOCKS[i]], capture_output=True,
                                  text=True, timeout=300)
        else:
            with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
                f.write(_BLOCKS[i])
            self.addCleanup(os.remove, f.name)
            # CPU ranks (gloo) on any machine: a GPU machine may have fewer GPUs than ranks.
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={ranks.group(1)}", f.name],
                                  capture_output=True, text=True, timeout=300, env=env)
        self.assertEqual(proc.returncode, 0, f"README block {i} failed:\n{_BLOCKS[i]}\n"
                                             f"{proc.stderr[-3000:]}")


if __name__ == "__main__":
    absltest.main()
