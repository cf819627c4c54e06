"""Data x tensor parallelism in torch: 4 gloo ranks as a 2 x 2 ("dp", "tp") mesh.

"The model" is a stack of two ``HybridBlock``s (TP over ``mesh["tp"]``) wrapped in DDP over
``mesh["dp"]`` (``sparsetp.backends.torch.parallel``), trained with the loss
``mean((model(x) - t) ** 2)`` over the local batch. Each rank returns the canonical (unsharded)
gradients, gathered over its TP group, and the parameters after one SGD step; the parent
compares them with the same stack run in one process on the whole global batch.

Tolerance (float32): the conventions' table through ``testing_utils.tolerance`` with gradients
at 2x and ``reduced = B * N`` (every weight gradient sums that many token contributions, whose
float32 rounding adds like a random walk). What differs from one process is only the order of
the sums: DDP averages two half-batch gradients, TP sums two half-width partial products, so
the errors are a few float32 ulps (~1e-7 relative) while a missing or doubled all-reduce, a
wrong batch slice or an un-averaged gradient is off by O(0.1-1). The two data replicas must
hold bitwise-equal parameters after the step (DDP hands both the same averaged gradient).

A rank that dies mid-step (``os._exit(1)`` before the forward) must not hang the others: each
surviving rank raises within 60 s with a message naming the failed collective, and exits.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queue_lib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
from absl.testing import absltest, parameterized
from torch import nn

from sparsetp.backends.torch import parallel
from sparsetp.backends.torch.block import HybridBlock
from sparsetp.backends.torch.comm import (
    gather_from_sequence_region,
    scatter_to_sequence_region,
)

try:  # pytest puts tests/ on sys.path (no package); a package layout reaches it as tests.*
    import dist_utils
    from dp_tp_common import BATCH, DP, LR, SEEDS, SEQ, TP, config, data
    from testing_utils import tolerance
except ImportError:  # pragma: no cover
    from tests import dist_utils
    from tests.dp_tp_common import BATCH, DP, LR, SEEDS, SEQ, TP, config, data
    from tests.testing_utils import tolerance


def _data():
    return tuple(torch.from_numpy(a) for a in data())


def _stack(cfg, group, sequence_parallel=False):
    return nn.Sequential(*(HybridBlock(cfg, group, seed=s, sequence_parallel=sequence_parallel)
                           for s in SEEDS))


def _reference(cfg):
    """One process, no torch.distributed: the same stack, loss and SGD step on the whole batch."""
    model = _stack(cfg, None)
    x, t = _data()
    loss = ((model(x) - t) ** 2).mean()
    loss.backward()
    grads = [b.export_grads() for b in model]
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.item(), grads, [b.export_params() for b in model]


def _train_step(rank, world, sequence_parallel):
    """One DDP x TP step on this rank; returns its coordinates, loss, grads and new params."""
    cfg = config()
    mesh = parallel.make_device_mesh(DP, TP, config=cfg, global_batch=BATCH)
    tp_group = mesh["tp"].get_group()
    model = parallel.data_parallel(_stack(cfg, tp_group, sequence_parallel), mesh)
    x, t = _data()
    x_local, t_local = parallel.shard_batch(x, mesh), parallel.shard_batch(t, mesh)
    if sequence_parallel:
        y = gather_from_sequence_region(model(scatter_to_sequence_region(x_local, tp_group)),
                                        tp_group)
    else:
        y = model(x_local)
    loss = ((y - t_local) ** 2).mean()  # a mean over the local batch: DDP averages over dp
    loss.backward()
    grads = [b.export_grads() for b in model.module]
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = [b.export_params() for b in model.module]
    # The global loss, for the report: the mean of the replicas' means (equal local batches).
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss, group=mesh["dp"].get_group())
    return dict(coords=(mesh.get_local_rank("dp"), mesh.get_local_rank("tp")),
                loss=float(global_loss) / DP, grads=grads, params=params)


class DataTensorParallelTest(parameterized.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ref_loss, cls.ref_grads, cls.ref_params = _reference(config())
        # The training steps (plain TP and SP) and the bad-mesh errors on the same 4 gloo ranks:
        # one launch (dist_utils.SharedLaunches; spawning 4 ranks costs ~8 s on 2 cores).
        cls.launches = launches = dist_utils.SharedLaunches()
        for sequence_parallel in (False, True):
            launches.add(f"train_sp{sequence_parallel}", DP * TP, _train_step, sequence_parallel,
                         backend="gloo", timeout=240.0, pg_timeout=120.0)
        launches.add("bad_mesh", 4, _bad_mesh_on_ranks, backend="gloo", timeout=120.0,
                     pg_timeout=60.0)

    @parameterized.named_parameters(("tp", False), ("tp_sp", True))
    def test_grads_and_step_equal_one_process(self, sequence_parallel):
        results = self.launches.result(f"train_sp{sequence_parallel}")
        self.assertEqual([r["coords"] for r in results], [(0, 0), (0, 1), (1, 0), (1, 1)])
        atol, rtol = tolerance("float32", grad=True, reduced=BATCH * SEQ)
        for rank, r in enumerate(results):
            self.assertAlmostEqual(r["loss"], self.ref_loss, delta=1e-5 * abs(self.ref_loss))
            for i in range(len(SEEDS)):
                for name, ref in self.ref_grads[i].items():
                    np.testing.assert_allclose(r["grads"][i][name], ref, atol=atol, rtol=rtol,
                                               err_msg=f"rank {rank} block {i} grad {name}")
                for name, ref in self.ref_params[i].items():
                    np.testing.assert_allclose(r["params"][i][name], ref, atol=LR * atol,
                                               rtol=rtol, err_msg=f"rank {rank} block {i} {name}")
        # DDP gives both data replicas the same averaged gradient: identical parameters.
        for i in range(len(SEEDS)):
            for name in self.ref_params[i]:
                np.testing.assert_array_equal(results[0]["params"][i][name],
                                              results[2]["params"][i][name], err_msg=name)

    def test_bad_mesh_errors_name_the_argument(self):
        """On 4 ranks (the launch of the training steps): see ``_bad_mesh_on_ranks``."""
        results = self.launches.result("bad_mesh")
        self.assertLen(results, 4)
        for errors in results:
            self.assertRegex(errors["world"], r"dp \* tp = 4 \* 2 = 8 must equal the world size 4")
            self.assertRegex(errors["heads"], r"num_heads=2 is not divisible by the "
                                              r"tensor-parallel size 4")
            self.assertRegex(errors["batch"], r"batch has 3 sequences along dim 0, not divisible "
                                              r"by the data-parallel size dp=2")
            self.assertRegex(errors["group"], r"tensor-parallel over a group of 4 ranks, not "
                                              r"mesh\['tp'\] \(2 ranks\)")


# ------------------------------------------------------------------------------- bad input
class BadSizesTest(absltest.TestCase):
    """Checked before any process group exists (the same answer on every rank)."""

    def test_tp_not_dividing_heads(self):
        with self.assertRaisesRegex(ValueError, r"num_heads=4 is not divisible by the "
                                                r"tensor-parallel size 3"):
            parallel.check_parallel_sizes(1, 3, config=config())

    def test_tp_not_dividing_kv_heads(self):
        with self.assertRaisesRegex(ValueError, r"num_kv_heads=2 is not divisible"):
            parallel.check_parallel_sizes(2, 4, config=config(num_kv_heads=2))

    def test_tp_not_dividing_d_ff(self):
        with self.assertRaisesRegex(ValueError, r"d_ff=130 is not divisible by the "
                                                r"tensor-parallel size 4"):
            parallel.check_parallel_sizes(1, 4, config=config(d_ff=130))

    def test_dp_not_dividing_batch(self):
        with self.assertRaisesRegex(ValueError, r"global_batch=5 is not divisible by the "
                                                r"data-parallel size dp=2"):
            parallel.check_parallel_sizes(2, 2, global_batch=5)

    def test_world_size(self):
        with self.assertRaisesRegex(ValueError, r"dp \* tp = 2 \* 3 = 6 must equal the world "
                                                r"size 4"):
            parallel.check_parallel_sizes(2, 3, world_size=4)

    def test_sizes_are_positive_ints(self):
        for dp, tp, arg in ((0, 1, "dp"), (1, 2.0, "tp"), (True, 1, "dp")):
            with self.assertRaisesRegex(ValueError, rf"{arg} must be a positive int"):
                parallel.check_parallel_sizes(dp, tp)

    def test_mesh_needs_torch_distributed(self):
        self.assertFalse(dist.is_initialized())
        with self.assertRaisesRegex(ValueError, r"needs torch.distributed initialised"):
            parallel.make_device_mesh(1, 1)

    def test_init_distributed_partial_torchrun_env(self):
        with self.assertRaisesRegex(ValueError, r"sets \['RANK'\] but not"):
            parallel.init_distributed("gloo", env={"RANK": "0"})
        with self.assertRaisesRegex(ValueError, r"timeout_s must be a finite number"):
            parallel.init_distributed("gloo", timeout_s=0)
        with self.assertRaisesRegex(ValueError, r"backend must be 'nccl', 'gloo' or None"):
            parallel.init_distributed("mpi")


def _bad_mesh_on_ranks(rank, world):
    """On 4 ranks: a mesh that is not the world, a batch dp does not divide, a block on the
    wrong group; every one a ValueError naming the argument (returned, not raised)."""
    cfg = config()
    errors = {}
    for key, call in (("world", lambda: parallel.make_device_mesh(4, 2)),
                      ("heads", lambda: parallel.make_device_mesh(1, 4, config=config(
                          num_heads=2, d_model=64)))):
        try:
            call()
        except ValueError as err:
            errors[key] = str(err)
    mesh = parallel.make_device_mesh(DP, TP)
    try:
        parallel.shard_batch(torch.zeros(3, SEQ, 64), mesh)
    except ValueError as err:
        errors["batch"] = str(err)
    try:  # group None is the default group of 4 ranks, not mesh["tp"]
        parallel.data_parallel(_stack(cfg, None), mesh)
    except ValueError as err:
        errors["group"] = str(err)
    return errors


# --------------------------------------------------------------------------------- dead rank
DEAD_RANK = 3
FAULT_PG_TIMEOUT_S = 45.0  # the backstop: under the 60 s bound even if gloo missed the death
EXIT_BOUND_S = 60.0


def _die_mid_step(rank, world, init_method, results):
    """Rank DEAD_RANK exits (no exception, no clean-up) just before the step's first
    collective; the others run the step and report how long they took to fail, and how."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=FAULT_PG_TIMEOUT_S))
    cfg = config()
    mesh = parallel.make_device_mesh(DP, TP, config=cfg, global_batch=BATCH)
    model = parallel.data_parallel(_stack(cfg, mesh["tp"].get_group()), mesh)
    x, t = _data()
    x_local, t_local = parallel.shard_batch(x, mesh), parallel.shard_batch(t, mesh)
    dist.barrier()  # everyone is set up; the step starts now
    if rank == DEAD_RANK:
        os._exit(1)
    t0 = time.monotonic()
    try:
        for _ in range(3):  # the first steps; a survivor must fail in one of them
            loss = ((model(x_local) - t_local) ** 2).mean()
            loss.backward()
        results.put((rank, "finished", time.monotonic() - t0, ""))
    except Exception as err:  # noqa: BLE001  (reported to the parent, which checks the type)
        results.put((rank, type(err).__name__, time.monotonic() - t0,
                     f"{err}\n{traceback.format_exc(limit=3)}"))
    # Exit as a failed training script would: the parent checks that exiting does not hang.


class DeadRankTest(absltest.TestCase):
    def test_survivors_fail_fast_with_a_message(self):
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        # A file rendezvous, as dist_utils.run_distributed: a free port can be taken by another
        # test process before rank 0 binds it.
        store_dir = tempfile.mkdtemp(prefix="sparsetp-pg-")
        init_method = "file://" + os.path.join(store_dir, "store")
        world = DP * TP
        procs = [ctx.Process(target=_die_mid_step, args=(r, world, init_method, results),
                             name=f"rank{r}", daemon=True) for r in range(world)]
        start = time.monotonic()
        try:
            for p in procs:
                p.start()
            reports = {}
            deadline = start + 180.0  # set-up (spawn, imports, groups) plus the 60 s bound
            while len(reports) < world - 1 and time.monotonic() < deadline:
                try:
                    rank, kind, elapsed, message = results.get(timeout=0.5)
                except queue_lib.Empty:
                    continue
                reports[rank] = (kind, elapsed, message)
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
            alive = [p.name for p in procs if p.is_alive()]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            results.close()
            results.join_thread()
            shutil.rmtree(store_dir, ignore_errors=True)
        for rank, (kind, elapsed, message) in sorted(reports.items()):  # for the log
            print(f"rank {rank}: {kind} after {elapsed:.2f} s: {message.splitlines()[0][:160]}")
        self.assertEqual(sorted(reports), [r for r in range(world) if r != DEAD_RANK],
                         f"reports: {reports}")
        self.assertEqual(alive, [], "ranks still running after the others failed")
        self.assertEqual(procs[DEAD_RANK].exitcode, 1)
        for rank, (kind, elapsed, message) in reports.items():
            # A TP collective raises CollectiveError itself; DDP's reducer runs the gradient
            # all-reduce's comm hook in C++ and re-raises its CollectiveError as a RuntimeError
            # that quotes it (type and message).
            if kind != "CollectiveError":
                self.assertEqual(kind, "RuntimeError", f"rank {rank}: {message}")
                self.assertIn("CollectiveError: DDP gradient all_reduce (dp)", message)
            self.assertLess(elapsed, EXIT_BOUND_S, f"rank {rank} took {elapsed:.1f} s")
            self.assertRegex(message, r"over a process group of 2 ranks failed on rank \d",
                             f"rank {rank}")


# ---------------------------------------------------------------------------- the example
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "dp_tp.py")


def _example(*cmd, flags=()):
    # CPU ranks on any machine (4 ranks, and a GPU machine may have fewer GPUs): torch then sees
    # no GPU, so init_distributed picks gloo.
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(EXAMPLE)),
                                                        os.environ.get("PYTHONPATH")])))
    out = subprocess.run([*cmd, EXAMPLE, "--steps=2", "--seq_len=128", *flags], env=env,
                         capture_output=True, text=True, timeout=240)
    return out.returncode, out.stdout + out.stderr


class ExampleTest(absltest.TestCase):
    """examples/dp_tp.py under torchrun (4 CPU ranks, no code change) trains like one process."""

    def test_torchrun_2x2_matches_one_process(self):
        code, alone = _example(sys.executable)
        self.assertEqual(code, 0, alone)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=4"]
        code, out = _example(*torchrun, flags=("--dp=2", "--tp=2", "--sequence_parallel"))
        self.assertEqual(code, 0, out)
        self.assertIn("dp=2 x tp=2 on 4 ranks (gloo, cpu)", out)
        losses = [re.findall(r"step \d: loss ([0-9.]+)", o) for o in (alone, out)]
        self.assertLen(losses[0], 2)
        np.testing.assert_allclose(np.float64(losses[1]), np.float64(losses[0]), rtol=1e-4)


if __name__ == "__main__":
    absltest.main()
