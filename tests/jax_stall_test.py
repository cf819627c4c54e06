"""No silent hang in a 2-process JAX job (issue #33): a stuck or dead peer ends the other.

Each case starts ``jax_stall_worker.py`` twice (``init_distributed(timeout_s=TIMEOUT_S)``, gloo
CPU collectives), lets one warm-up all-reduce pass, then one process misbehaves before the
second step and the other must exit, non-zero, within ``2 * TIMEOUT_S`` of entering that step
with a message naming what it was waiting for:

* stuck (alive, heartbeating; JAX alone would wait 30 minutes in gloo): the ``deadline``
  watchdog ends it after ``TIMEOUT_S`` with "train step did not finish within 5 s";
* dead (``os._exit(1)``): gloo's all-reduce fails at once ("Gloo all-reduce failed"), with the
  note "raised during train step"; the exit then waits at most the heartbeat timeout.

The harness never hangs: every wait has a timeout and both processes are SIGKILLed in
``finally`` (JAX's preemption notifier catches SIGTERM, so SIGTERM would not end them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import dist_utils  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_stall_worker.py")
TIMEOUT_S = 5  # init_distributed's timeout_s: the deadline and JAX's heartbeat/shutdown ones
START_S = 60  # startup + warm-up bound (2 shared CPU cores), never part of the measurement


class JaxStalledPeerTest(parameterized.TestCase):
    def _run(self, bad, mode):
        """Start both processes; return (survivor's log, exit code, seconds from ENTER to exit)."""
        coordinator = f"127.0.0.1:{dist_utils.free_port()}"
        root = os.path.dirname(os.path.dirname(WORKER))
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        env.pop("XLA_FLAGS", None)
        survivor = 1 - bad
        procs = [subprocess.Popen([sys.executable, WORKER, coordinator, str(i), str(TIMEOUT_S),
                                   str(bad), mode], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for i in range(2)]
        try:
            entered = None
            lines = []
            deadline = time.monotonic() + START_S
            for line in procs[survivor].stdout:  # until ENTER (or exit)
                lines.append(line)
                if line.startswith("ENTER"):
                    entered = float(line.split()[1])
                    break
                if time.monotonic() > deadline:
                    break
            self.assertIsNotNone(entered, "survivor never reached the step:\n" + "".join(lines))
            try:
                rest = procs[survivor].communicate(timeout=4 * TIMEOUT_S)[0]
            except subprocess.TimeoutExpired:
                self.fail(f"process {survivor} still running {4 * TIMEOUT_S} s after the step "
                          f"began:\n{''.join(lines)}")
            elapsed = time.time() - entered
            return "".join(lines) + rest, procs[survivor].returncode, elapsed
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.communicate()

    @parameterized.named_parameters(("process1", 1), ("process0_coordinator", 0))
    def test_stuck_peer(self, bad):
        from sparsetp.backends.jax.distributed import DEADLINE_EXIT_CODE  # noqa: PLC0415

        log, rc, elapsed = self._run(bad, "stall")
        print(f"stuck process {bad}: survivor exited after {elapsed:.1f} s, rc={rc}")
        self.assertEqual(rc, DEADLINE_EXIT_CODE, log[-3000:])
        self.assertRegex(log, rf"sparsetp: process {1 - bad} of 2: train step did not finish "
                              rf"within {TIMEOUT_S} s")
        self.assertNotIn("DONE", log)
        self.assertGreaterEqual(elapsed, TIMEOUT_S - 0.5)
        self.assertLess(elapsed, 2 * TIMEOUT_S, log[-3000:])

    def test_dead_peer(self):
        log, rc, elapsed = self._run(1, "die")
        print(f"dead process 1: survivor exited after {elapsed:.1f} s, rc={rc}")
        self.assertNotEqual(rc, 0, log[-3000:])
        self.assertIn("Gloo all-reduce failed", log)
        if sys.version_info >= (3, 11):
            self.assertIn("sparsetp: process 0 of 2: raised during train step", log)
        self.assertNotIn("DONE", log)
        self.assertLess(elapsed, 2 * TIMEOUT_S, log[-3000:])


if __name__ == "__main__":
    absltest.main()
