"""``python -m sparsetp.bench tp --preset=cpu`` end to end (gloo, 2 processes, JAX 2 host devices).

The ``cpu`` preset runs on CPU ranks on any machine (``tp.resolve_device``: a GPU machine too),
so these checks hold on a one-GPU machine as on a CPU one; the same tool on 2 GPUs (NCCL, JAX on
the GPUs) runs only where torch sees 2 GPUs.

The CPU numbers themselves mean nothing (2 cores shared by the ranks); what is checked is that
the tool measures what it says: every stage is present and passed, efficiencies are computed
from the recorded times, per-GPU parameter and saved-activation bytes equal what the parameter
shapes and the TP/DP/pipeline split imply, the all-reduce table is self-consistent, the overlap
comparison ran both paths, the JAX HLO has all-reduces exactly where TP needs them, and a budget
too small to run anything still records every stage (as skipped) instead of dropping it.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import testing_utils as tu
import torch
from absl.testing import absltest

from sparsetp.bench import tp

ALL_STAGES = ["comm", "torch_mlp", "torch_overlap", "torch_overlap_ab", "dtensor", "ddp",
              "pipeline", "torch_block",
              "jax:jax_mlp", "jax:jax_dp", "jax:jax_block", "jax:jax_overlap",
              "jax:jax_block_overlap", "jax_lhs_on:jax_mlp_world", "jax_lhs_off:jax_mlp_world"]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _bench(out_dir, *extra, timeout=240):
    return tu.run_json_script(["-m", "sparsetp.bench", "tp", "--preset=cpu", "--tp_world=2",
                               f"--out_dir={out_dir}", *extra],
                              os.path.join(out_dir, "tp.json"), timeout)


class BenchTpTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.out_dir = tempfile.mkdtemp(prefix="bench_tp_test_")
        cls.proc, cls.res = _bench(cls.out_dir)
        cls.spec = cls.res["spec"]

    def test_every_stage_ran(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stdout[-2000:] +
                         self.proc.stderr[-4000:])
        stages = self.res["stages"]
        for name in ALL_STAGES:
            self.assertIn(name, stages)
            self.assertTrue(stages[name]["ok"], f"{name}: {stages[name].get('error')}")
        self.assertEqual(self.res["failed_or_skipped"], [])
        self.assertEqual(self.spec["world"], 2)
        # The cpu preset ran on CPU, whatever GPUs the machine has, and says so.
        self.assertEqual(self.spec["device"], "cpu")
        self.assertTrue(self.res["versions"]["device"].startswith("cpu ("),
                        self.res["versions"]["device"])
        self.assertEqual(self.res["versions"]["gpus_visible"], _gpus())
        for name in ("jax:jax_mlp", "jax:jax_block"):
            self.assertTrue(all(d.startswith("cpu") for d in stages[name]["devices"]),
                            stages[name]["devices"])

    def test_efficiency_is_computed_from_the_times(self):
        rows = [r for r in self.res["rows"] if "efficiency" in r]
        self.assertGreaterEqual(len(rows), 12)  # torch/jax x mlp/block x fwd/fwd_bwd x p, dtensor
        for r in rows:
            t1 = [b["median_ms"] for b in self.res["rows"] if b["p"] == 1
                  and b["model"] == r["model"] and b["mode"] == r["mode"]
                  and b["parallelism"] == "tp" and not b["variant"]
                  and b["framework"] == ("torch" if r["framework"] == "dtensor"
                                         else r["framework"])]
            self.assertLen(t1, 1)
            self.assertAlmostEqual(r["efficiency"], t1[0] / (r["p"] * r["median_ms"]), places=12)
            self.assertAlmostEqual(r["tflops_per_gpu"],
                                   r["flops"] / r["p"] / (r["median_ms"] / 1e3) / 1e12,
                                   places=9)
        keys = {(r["framework"], r["model"], r["mode"], r["p"]) for r in rows}
        for fw in ("torch", "jax"):
            for model in ("mlp", "block"):
                for mode in ("fwd", "fwd_bwd"):
                    for p in (1, 2):
                        self.assertIn((fw, model, mode, p), keys)
        self.assertIn(("dtensor", "mlp", "fwd_bwd", 2), keys)

    def test_memory_matches_parameter_shapes(self):
        st, spec = self.res["stages"], self.spec
        d, ff, e = spec["d_model"], spec["d_ff"], 4  # float32
        tokens = spec["batch"] * spec["seq_len"]
        for p in (1, 2):  # TP: W1, b1, W2 split; b2 replicated. Saved: x, fc1 out, GELU out.
            self.assertEqual(tp.mlp_param_bytes(spec, p), e * (2 * d * ff // p + ff // p + d))
            self.assertEqual(tp.mlp_saved_bytes(spec, p), e * (tokens * d + 2 * tokens * ff // p))
        for name in ("torch_mlp", "dtensor", "ddp"):
            layout = "dp" if name == "ddp" else "tp"
            for rank in st[name]["ranks"]:
                for case in rank["data"]:
                    p = case["p"] if layout == "tp" else 2
                    self.assertEqual(case["param_bytes"], tp.mlp_param_bytes(spec, p, layout),
                                     name)
                    self.assertEqual(case["saved_activation_bytes"],
                                     tp.mlp_saved_bytes(spec, p, layout), name)
        stage_params = sorted(c["param_bytes"] for r in st["pipeline"]["ranks"]
                              for c in r["data"])
        self.assertEqual(stage_params, sorted([e * (d * ff + ff), e * (ff * d + d)]))
        # Stage 0 computes its input gradient, as every torch step of the bench does.
        self.assertEqual([c.get("input_grad") for r in st["pipeline"]["ranks"]
                          for c in r["data"] if c["stage"] == 0], [True])
        for case in st["jax:jax_mlp"]["data"]:
            self.assertEqual(case["param_bytes"], tp.mlp_param_bytes(spec, case["p"]))
        for case in st["jax:jax_dp"]["data"]:
            self.assertEqual(case["param_bytes"], tp.mlp_param_bytes(spec, 1, "dp"))

    def test_jax_block_params_in_the_compute_dtype(self):
        """The JAX block stage holds its parameters in config.dtype, as torch does (float32
        arrays made every bf16 step cast them and doubled the reported parameter bytes)."""
        import numpy as np

        cfg = tp._config({**self.spec, "dtype": "bfloat16"})
        params = tp._jax_block_params(cfg, np.random.default_rng(0))
        self.assertEqual({str(a.dtype) for a in params.values()}, {"bfloat16"})
        self.assertEqual(float(params["ln1.weight"].astype("float32").min()), 1.0)

    def test_jax_block_inputs_sit_on_the_mesh(self):
        """The JAX block stages give hybrid_block x and dy laid out as a previous block leaves
        them (replicated; split along the tokens under SP), so no timed call copies its input
        from one device to the others (a cost a model pays once, not per block)."""
        import jax_test_utils as jtu
        import numpy as np

        mesh = jtu.mesh(2)
        cfg = tp._config({**self.spec, "dtype": "float32"})
        a = np.arange(2 * 8 * 4, dtype=np.float32).reshape(2, 8, 4)
        for sp, shard_shape in ((False, (2, 8, 4)), (True, (2, 4, 4))):
            x = tp._jax_block_input(a, cfg, mesh, sp)
            self.assertEqual(set(x.sharding.device_set), set(mesh.devices.flat), msg=f"sp={sp}")
            self.assertEqual({s.data.shape for s in x.addressable_shards}, {shard_shape},
                             msg=f"sp={sp}")
            self.assertEqual(x.sharding.is_fully_replicated, not sp)
            np.testing.assert_array_equal(np.asarray(x), a)

    def test_comm_table_and_volumes(self):
        comm = self.res["stages"]["comm"]["data"]
        self.assertEqual([c["bytes"] for c in comm], self.spec["comm_sizes"])
        for c in comm:
            self.assertGreater(c["latency_us"], 0)
            self.assertAlmostEqual(c["busbw_gbps"], c["algbw_gbps"] * 2 * (2 - 1) / 2)
        rows = {(r["framework"], r["parallelism"], r["mode"], r["p"]): r
                for r in self.res["rows"] if r["model"] == "mlp" and not r["variant"]}
        msg = self.spec["batch"] * self.spec["seq_len"] * self.spec["d_model"] * 4
        self.assertEqual(rows["torch", "tp", "fwd_bwd", 2]["comm"],
                         # two all-reduces, a ring sends 2 (p - 1) / p = 1 message each at p = 2
                         dict(collectives=2, message_bytes=msg, sent_per_gpu_bytes=2 * msg))
        dp = rows["torch", "dp", "fwd_bwd", 2]
        self.assertEqual(dp["comm"]["message_bytes"], dp["param_bytes"])
        self.assertEqual(rows["torch", "tp", "fwd_bwd", 1]["comm"]["collectives"], 0)

    def test_overlap_stage_times_both_paths(self):
        # Every arm (overlap_comm, comm_chunks) of both models at each TP size > 1, and a row
        # in the table for each.
        cases = self.res["stages"]["torch_overlap"]["ranks"][0]["data"]
        want = sorted((m, 2, o, k) for m in ("block", "mlp") for o, k in tp.OVERLAP_ARMS)
        self.assertEqual(sorted((c["model"], c["p"], c["overlap_comm"], c["comm_chunks"])
                                for c in cases), want)
        variants = {(r["model"], r["p"], r["variant"]) for r in self.res["rows"]
                    if r["framework"] == "torch" and r["mode"] == "fwd_bwd"}
        for m, p, o, k in want:
            self.assertIn((m, p, f"chunks{k}" if o else "no_overlap"), variants)

    def test_overlap_ab_interleaves_every_arm(self):
        # The default schedule against the plain one (and, without SP, no overlap), both
        # models, forward and fwd+bwd, each arm timed in the same rounds with its ratio.
        cases = self.res["stages"]["torch_overlap_ab"]["ranks"][0]["data"]
        self.assertEqual(sorted((c["model"], c["sequence_parallel"]) for c in cases),
                         [("block", False), ("block", True), ("mlp", False), ("mlp", True)])
        for c in cases:
            arms = ["auto", "plain"] + ([] if c["sequence_parallel"] else ["no_overlap"])
            for mode in ("fwd", "fwd_bwd"):
                r = c[mode]
                self.assertEqual(r["rounds"], self.spec["iters"])
                for arm in arms:
                    self.assertGreater(r[f"{arm}_{mode}_ms"], 0)
                # Each ratio is the median of per-round ratios (timings: no bound on them).
                self.assertEqual(sorted(k for k in r if "_over_" in k),
                                 sorted(f"{arm}_over_auto" for arm in arms[1:]))
                for arm in arms[1:]:
                    self.assertGreater(r[f"{arm}_over_auto"], 0)

    def test_jax_hlo_all_reduce_count(self):
        # Forward: the one psum of fc2 (kept even on a 1-device mesh). Step: that one and the
        # psum of d(x), which XLA's all-reduce combiner may merge into one instruction.
        for case in self.res["stages"]["jax:jax_mlp"]["data"]:
            counts = {}
            for mode in ("fwd", "fwd_bwd"):
                hlo = case[mode]["hlo"]
                counts[mode] = hlo["sync_all_reduces"] + len(hlo["async_all_reduces"])
            self.assertEqual(counts["fwd"], 1, case["p"])
            self.assertIn(counts["fwd_bwd"], (1, 2), case["p"])
        for label, val in (("jax_lhs_on", "true"), ("jax_lhs_off", "false")):
            self.assertIn(f"--xla_gpu_enable_latency_hiding_scheduler={val}",
                          self.res["stages"][f"{label}:jax_mlp_world"]["xla_flags"])

    def test_jax_overlap_rows(self):
        """The JAX A/B at TP = world: every variant of both models, with its efficiency against
        JAX's plain TP=1 time; the SP overlap HLO moves activations by collective-permutes
        only, the plain SP one by an all-gather and a reduce-scatter."""
        variants = set(tp.JAX_OVERLAP_VARIANTS)
        for stage, model in (("jax:jax_overlap", "mlp"), ("jax:jax_block_overlap", "block")):
            cases = {c["variant"]: c for c in self.res["stages"][stage]["data"]}
            self.assertEqual(set(cases), variants)
            self.assertEqual({c["p"] for c in cases.values()}, {2})
            fwd = cases["sp_overlap"]["fwd"]["hlo"]
            self.assertGreater(fwd["sync_collective_permutes"] + len(
                fwd["async_collective_permutes"]), 0, stage)
            for op in ("all_gathers", "reduce_scatters", "all_reduces"):
                self.assertEqual(fwd[f"sync_{op}"] + len(fwd[f"async_{op}"]), 0, (stage, op))
            plain = cases["sp_plain"]["fwd"]["hlo"]
            self.assertGreater(plain["sync_all_gathers"] + len(plain["async_all_gathers"]), 0)
            rows = {(r["variant"], r["mode"]): r for r in self.res["rows"]
                    if r["framework"] == "jax" and r["model"] == model and r["variant"] in variants}
            self.assertEqual(set(rows), {(v, m) for v in variants for m in ("fwd", "fwd_bwd")})
            for r in rows.values():
                self.assertIn("efficiency", r)

    def test_plots_or_recorded_warning(self):
        if importlib.util.find_spec("matplotlib") is None:
            self.assertTrue(any("matplotlib" in w for w in self.res["warnings"]))
        else:
            self.assertLen(self.res["plots"], 2)
            for path in self.res["plots"]:
                self.assertGreater(os.path.getsize(path), 1000)

    def test_no_budget_records_every_stage_as_skipped(self):
        out_dir = tempfile.mkdtemp(prefix="bench_tp_budget_")
        proc, res = _bench(out_dir, "--budget_s=0.5", "--tp_stages=comm,torch_mlp,jax",
                           "--notp_jax_variants", timeout=120)
        self.assertEqual(proc.returncode, 1)  # nothing ran: not a success
        for name in ("comm", "torch_mlp", "jax:jax_mlp", "jax:jax_dp", "jax:jax_block"):
            self.assertIn(name, res["stages"])
            entry = res["stages"][name]
            self.assertFalse(entry["ok"])
            self.assertTrue(entry.get("skipped") or entry.get("error"), name)
        self.assertEqual(res["rows"], [])


class DeviceRuleTest(absltest.TestCase):
    def test_preset_picks_the_device(self):
        """cpu preset on CPU ranks (GPU machine or not); gpu2 one rank per GPU, 2 GPUs needed;
        an explicit --device wins; every failure names what it needs."""
        rule = tp.resolve_device
        for gpus in (0, 1, 2, 8):
            self.assertEqual(rule("cpu", "auto", gpus, None), ("cpu", 4))
            self.assertEqual(rule("cpu", "auto", gpus, 2), ("cpu", 2))
            self.assertEqual(rule("gpu2", "cpu", gpus, None), ("cpu", 4))
        self.assertEqual(rule("gpu2", "auto", 2, None), ("cuda", 2))
        self.assertEqual(rule("gpu2", "auto", 8, None), ("cuda", 8))
        self.assertEqual(rule("cpu", "cuda", 2, 2), ("cuda", 2))
        for preset, device, gpus, world, need in (("gpu2", "auto", 1, None, 2),
                                                  ("gpu2", "auto", 0, None, 2),
                                                  ("cpu", "cuda", 2, None, 4),
                                                  ("gpu2", "cuda", 2, 4, 4)):
            with self.assertRaisesRegex(ValueError, f"--preset={preset} on the GPUs needs "
                                                    f"{need} GPUs \\(one rank each\\); torch "
                                                    f"sees {gpus}"):
                rule(preset, device, gpus, world)
        with self.assertRaisesRegex(ValueError, "needs at least 2 ranks"):
            rule("cpu", "auto", 1, 1)
        with self.assertRaisesRegex(ValueError, "--preset must be one of"):
            rule("gpu1", "auto", 1, None)


@absltest.skipIf(_gpus() < 2, f"needs 2 GPUs (NCCL ranks, JAX on the GPUs); torch sees {_gpus()}")
class BenchTpTwoGpuTest(absltest.TestCase):
    def test_cpu_shapes_on_two_gpus(self):
        """The tool's GPU path at the cpu preset's tiny shapes: NCCL ranks, JAX on 2 GPUs."""
        out_dir = tempfile.mkdtemp(prefix="bench_tp_gpu_")
        proc, res = _bench(out_dir, "--device=cuda", "--notp_jax_variants", timeout=400)
        self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-4000:])
        self.assertEqual((res["spec"]["device"], res["spec"]["world"]), ("cuda", 2))
        self.assertEqual(res["failed_or_skipped"], [])
        self.assertEqual(res["versions"]["device_count"], _gpus())
        for name in ("jax:jax_mlp", "jax:jax_block"):
            self.assertTrue(all(d.startswith(("cuda", "gpu"))
                                for d in res["stages"][name]["devices"]),
                            res["stages"][name]["devices"])


if __name__ == "__main__":
    absltest.main()
