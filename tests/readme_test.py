"""Every ```python block of README.md runs as written (each in a fresh interpreter)."""

import os
import re
import subprocess
import sys

from absl.testing import absltest, parameterized

_README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
with open(_README) as f:
    _BLOCKS = re.findall(r"```python\n(.*?)```", f.read(), re.S)


class ReadmeTest(parameterized.TestCase):
    def test_readme_has_examples(self):
        self.assertGreaterEqual(len(_BLOCKS), 3)

    @parameterized.parameters(range(len(_BLOCKS)))
    def test_block_runs(self, i):
        proc = subprocess.run([sys.executable, "-c", _BLOCKS[i]], capture_output=True, text=True,
                              timeout=300)
        self.assertEqual(proc.returncode, 0, f"README block {i} failed:\n{_BLOCKS[i]}\n"
                                             f"{proc.stderr[-3000:]}")


if __name__ == "__main__":
    absltest.main()
