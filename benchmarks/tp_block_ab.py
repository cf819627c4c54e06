"""Where the TP=2 block's collectives are exposed, and schedules that hide them (issue #26).

Two GPUs. For the ``gpu2`` preset's MLP and HybridBlock, with and without sequence parallelism:
1. interleaved A/B (``sparsetp.bench.tp._interleaved``) of TP=1 (a one-rank group) and TP=2 arms,
   so efficiency ``t1 / (2 t2)`` comes from one run; under SP, TP=1 is timed in its own
   interleaved group on the full input;
2. a torch-profiler pass per arm: NCCL time with no compute kernel beside it ("exposed"),
   by NCCL kernel name, and GEMM time by operator and input shapes;
3. the mean SM clock and board power of rank 0's GPU while each arm runs (``clocks``): every
   arm runs at the 700 W cap, and the TP=2 arms' clocks sit 1.7-2.5% below ``nocomm``'s
   (session 28), which is why their GEMMs run slower even with no collective beside them.

Arms (TP=2): ``auto`` (the library's default); ``outK``: the attention output projection
(row-parallel) with ``comm_chunks=K`` (under SP, 1 is the plain reduce-scatter, the auto choice
before session 27; without SP, K pieces make K / 2 all-reduce waves); ``percall``: under SP,
the replicated parameters' gradients (layer norms, row-parallel biases) all-reduced one call
each, as before session 27 (the library sums them in one); ``nocomm``: the TP=2 model with its
collectives removed (:func:`_no_comm`), the ceiling of any schedule. Arms join
with ``+`` (``out1+percall``: the SP block as it was before session 27); ``fc2xK``: fc2 with
``comm_chunks=K`` (K / 2 all-reduce waves at TP=2; auto gives 4 pieces at ``gpu2``). ``CASES``
picks the set: ``final`` (default) or ``waves``.

    [CASES=waves] PYTHONPATH=$PWD python benchmarks/tp_block_ab.py OUT_JSON [rounds]
"""
import collections
import json
import os


def _per_param_block(blk):
    """``blk`` (a sequence-parallel HybridBlock) summing its six replicated parameters'
    gradients in one all-reduce EACH (``copy_to_region`` per parameter), the block's schedule
    before session 27; the same numbers."""
    import torch.nn.functional as F  # noqa: PLC0415

    from sparsetp.backends.torch.comm import copy_to_region  # noqa: PLC0415

    def norm(ln, x):
        return F.layer_norm(x, ln.normalized_shape, copy_to_region(ln.weight, blk.group),
                            copy_to_region(ln.bias, blk.group), ln.eps)

    def forward(x):
        y1 = x + blk.attn(norm(blk.ln1, x))  # the row layers' own copy_to_region on biases
        return y1 + blk.mlp(norm(blk.ln2, y1))
    blk.forward = forward
    return blk


def _no_comm(m, solo):
    """``m`` (a TP=2 MLP or non-SP block) with every linear layer's collectives removed: the
    same half-width GEMMs, attention heads and replicated work, no communication. Its time is
    the ceiling any schedule of the collectives can reach."""
    from sparsetp.backends.torch.layers import _ParallelLinear  # noqa: PLC0415

    for lin in m.modules():
        if isinstance(lin, _ParallelLinear):
            lin.world_size, lin.group = 1, solo
    return m


def _clocks(m, x, dy, gpu: int, steps: int) -> dict | None:
    """Mean SM clock (MHz) and board power (W) of GPU ``gpu`` while ``m`` runs ``steps`` fwd+bwd
    steps back to back (``nvidia-smi`` sampled every 50 ms; the first 0.5 s dropped). Every
    rank runs the same steps (their collectives pair up); only the caller's GPU is read. None
    without nvidia-smi."""
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from tp_profile import fwd_bwd_step  # noqa: PLC0415

    if shutil.which("nvidia-smi") is None:
        return None
    step = fwd_bwd_step(m, x, dy)
    log = subprocess.Popen(["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    for i in range(steps):
        step()
        if i % 4 == 3:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    log.terminate()
    lines = log.communicate()[0].strip().splitlines()[10:]
    vals = [[float(v) for v in ln.split(",")] for ln in lines if ln.count(",") == 1]
    if not vals:
        return None
    return dict(sm_mhz=round(sum(v[0] for v in vals) / len(vals), 1),
                watts=round(sum(v[1] for v in vals) / len(vals), 1), samples=len(vals),
                steps=steps)


def _profile(m, x, dy, steps=4):
    """GEMM ms, NCCL ms and exposed NCCL ms by kernel name, per fwd+bwd step."""
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    from tp_profile import cat, exposed_ms, fwd_bwd_step  # noqa: PLC0415

    step = fwd_bwd_step(m, x, dy)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    comp, nccl = [], []
    sums = collections.Counter()
    for ev in prof.events():
        if ev.device_type.name != "CUDA" or ev.device_time_total <= 0 or ev.name.startswith(
                "nccl:"):
            continue
        c = cat(ev.name)
        sums[c] += ev.device_time_total / steps / 1e3
        if c == "nccl":
            nccl.append((ev.time_range.start, ev.time_range.end, ev.name.split("(")[0]))
        else:
            comp.append((ev.time_range.start, ev.time_range.end))
    exposed = exposed_ms(comp, nccl, steps)
    gemms = collections.Counter()
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key in ("aten::mm", "aten::addmm", "aten::bmm"):  # leaf GEMM ops
            key = f"{ev.key} {ev.input_shapes} x{ev.count // steps}"
            gemms[key] += ev.device_time_total / steps / 1e3
    return dict(by_cat={k: round(v, 3) for k, v in sums.most_common()},
                gemm_by_shape={k: round(v, 3) for k, v in gemms.most_common(24)},
                nccl_exposed_by_kernel={k: round(v, 3) for k, v in exposed.most_common()},
                nccl_exposed_ms=round(sum(exposed.values()), 3))


def rank_main(rank, world, port, out, rounds):
    import torch
    import torch.distributed as dist
    from tp_nccl_ctas_ab import init_ranks  # benchmarks/, the script's own directory

    from sparsetp.bench import tp as T

    device, group, _, solo = init_ranks(rank, world, port)
    spec = T.resolve_spec("gpu2", world, "cuda")
    cases = {"final": [("mlp", False, ("auto", "nocomm")),
                       ("mlp", True, ("auto",)),
                       ("block", False, ("auto", "nocomm")),
                       ("block", True, ("auto", "out1", "percall", "out1+percall"))],
             "waves": [("mlp", False, ("auto", "fc2x6", "fc2x8", "nocomm")),
                       ("block", False, ("auto", "out2", "fc2x8", "out2+fc2x8", "nocomm"))]
             }[os.environ.get("CASES", "final")]
    rows = []
    for model, sp, arms in cases:
        gen, x, dy = T._bench_inputs(spec, device)
        tp1 = T._tp_model(model, spec, solo, device, gen, False, True, None)
        models = {}
        for arm in arms:
            m = T._tp_model(model, spec, group, device, gen, sp, True, None)
            for part in arm.split("+"):
                if part == "nocomm":
                    _no_comm(m, solo)
                elif part.startswith("out"):
                    m.attn.out.comm_chunks = int(part[3:])
                elif part.startswith("fc2x"):
                    (m if model == "mlp" else m.mlp).fc2.comm_chunks = int(part[4:])
                elif part == "percall":
                    _per_param_block(m)
                elif part != "auto":
                    raise ValueError(f"unknown arm {part!r}")
            models[arm] = m
        xs, dys = T._seq_shards(group, x, dy) if sp else (x, dy)
        row = dict(model=model, sequence_parallel=sp)
        for mode in ("fwd", "fwd_bwd"):
            if sp:
                row[mode] = T._interleaved(models, xs, dys, device, rounds, group, mode=mode)
                row[mode + "_tp1"] = T._interleaved({"tp1": tp1}, x, dy, device, rounds, group,
                                                    mode=mode)
                t1 = row[mode + "_tp1"][f"tp1_{mode}_ms"]
            else:
                row[mode] = T._interleaved({"tp1": tp1, **models}, x, dy, device, rounds,
                                           group, mode=mode)
                t1 = row[mode][f"tp1_{mode}_ms"]
            row[mode + "_efficiency"] = {a: round(t1 / (2 * row[mode][f"{a}_{mode}_ms"]), 4)
                                         for a in arms}
        # About 2.5 s of steps per arm, counted on rank 0 so both ranks run the same steps.
        ms = dict(row["fwd_bwd"], **row.get("fwd_bwd_tp1", {}))
        counts = [{a: max(8, int(2500 / ms[f"{a}_fwd_bwd_ms"])) for a in [*arms, "tp1"]}]
        dist.broadcast_object_list(counts, src=0, group=group)
        row["clocks"] = {a: _clocks(m, xs, dys, rank, counts[0][a]) for a, m in models.items()}
        row["clocks"]["tp1"] = _clocks(tp1, x, dy, rank, counts[0]["tp1"])
        row["profile"] = {a: _profile(m, xs, dys) for a, m in models.items()}
        row["profile"]["tp1"] = _profile(tp1, x, dy)
        rows.append(row)
        if rank == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            for a, p in row["profile"].items():
                print("  ", a, json.dumps(p), flush=True)
        models = tp1 = m = None
        torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(rows=rows, rounds=rounds, torch=torch.__version__,
                           nccl=".".join(map(str, torch.cuda.nccl.version())),
                           device=torch.cuda.get_device_name()), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from tp_nccl_ctas_ab import run_two_ranks  # benchmarks/, the script's own directory
    run_two_ranks(rank_main, 29513, 15)
