"""Where the TP=2 MLP and block lose against TP=1 (issue #26): torch profiler, 2 GPUs.

Per arm, 4 profiled fwd+bwd steps: GPU kernel time by category (GEMM, NCCL, attention, layer
norm, ...), the GPU's busy time, the time NCCL runs with no compute kernel beside it ("exposed"),
and 10 unprofiled steps' wall time (sequential arms: for A/B decisions use the interleaved
``tp_nccl_ctas_ab.py`` or ``python -m sparsetp.bench tp --tp_stages=torch_overlap_ab``). Arms:
TP=1, TP=2 default, TP=2 with no overlap, cuBLAS SM carve-out
(``torch._C._set_sm_carveout_experimental``) with NCCL ``max_ctas`` to match, SP.
Results: ``benchmarks/results/tp_profile_h200x2.json``.

    PYTHONPATH=$PWD python benchmarks/tp_profile.py OUT_DIR
"""
import collections
import json
import os
import sys


def cat(name):
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "attention" in n or "_attn" in n or "dkdv" in n or "_dq" in n or "preprocess" in n:
        return "attention"
    if "gemm" in n or "nvjet" in n or "xmma" in n or "cutlass" in n or "sm90" in n:
        return "gemm"
    if "layer_norm" in n or "layernorm" in n:
        return "layernorm"
    if "gelu" in n:
        return "gelu"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def _covered(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def exposed_ms(compute, nccl, steps: int) -> collections.Counter:
    """ms per step that each NCCL kernel (by name) runs with no compute kernel beside it:
    ``compute`` ``(start, end)`` and ``nccl`` ``(start, end, name)`` intervals in µs, ``steps``
    steps traced."""
    compute = sorted(compute)
    out = collections.Counter()
    for s, e, name in nccl:
        cover = _covered([(max(s, a), min(e, b)) for a, b in compute if a < e and b > s])
        out[name] += (e - s - cover) / steps / 1e3
    return out


def fwd_bwd_step(m, x, dy):
    """A fwd+bwd step of module ``m`` on ``x`` (a leaf that takes its gradient) with output
    gradient ``dy``, gradients cleared first so steps do not accumulate."""
    x = x.detach().requires_grad_(True)
    params = list(m.parameters())

    def step():
        for q in params:
            q.grad = None
        x.grad = None
        m(x).backward(dy)
    return step


def rank_main(rank, world, port, out):
    import time

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from tp_nccl_ctas_ab import init_ranks  # benchmarks/, the script's own directory

    from sparsetp.bench import tp as T

    device, g2, gc, solo = init_ranks(rank, world, port, (8, 16))
    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if rank == 0:
        print("carveout fn:", carve, flush=True)
    spec = T.resolve_spec("gpu2", world, "cuda")
    report = {}
    arms = [("mlp_tp1", "mlp", solo, False, True, None, None),
            ("mlp_tp2", "mlp", g2, False, True, None, None),
            ("mlp_tp2_plain_nooverlap", "mlp", g2, False, False, 1, None),
            ("mlp_tp2_carve8", "mlp", gc[8], False, True, None, 8),
            ("mlp_tp2_carve16", "mlp", gc[16], False, True, None, 16),
            ("mlp_tp2_carve16_defaultnccl", "mlp", g2, False, True, None, 16),
            ("block_tp1", "block", solo, False, True, None, None),
            ("block_tp2", "block", g2, False, True, None, None),
            ("block_tp2_carve16", "block", gc[16], False, True, None, 16),
            ("block_tp2_sp", "block", g2, True, True, None, None),
            ("block_tp2_sp_carve16", "block", gc[16], True, True, None, 16)]
    for label, model, group, sp, overlap, chunks, cv in arms:
        if cv is not None and carve is None:
            continue
        if carve is not None:
            try:
                carve(cv)
            except TypeError:
                carve(cv or 0)
        gen, x, dy = T._bench_inputs(spec, device)
        m = T._tp_model(model, spec, group, device, gen, sp, overlap, chunks)
        if sp:
            x, dy = T._seq_shards(g2, x, dy)
        step = fwd_bwd_step(m, x, dy)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        steps = 4
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / steps * 1e3
        sums = collections.Counter()
        kern = collections.Counter()
        intervals = []
        for ev in prof.events():
            if (ev.device_type.name == "CUDA" and ev.device_time_total > 0
                    and not ev.name.startswith("nccl:")):
                sums[cat(ev.name)] += ev.device_time_total / steps / 1e3
                kern[ev.name[:90]] += ev.device_time_total / steps / 1e3
                intervals.append((ev.time_range.start, ev.time_range.end, cat(ev.name)))
        # GPU busy time (union of kernel intervals) and the part of it with no compute kernel.
        busy = _covered((s, e) for s, e, _ in intervals)
        comp_busy = _covered((s, e) for s, e, c in intervals if c != "nccl")
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        wall2 = (time.perf_counter() - t) / 10 * 1e3
        report[label] = dict(wall_ms=wall, wall_noprof_ms=wall2, busy_ms=busy / steps / 1e3,
                             compute_busy_ms=comp_busy / steps / 1e3,
                             nccl_exposed_ms=(busy - comp_busy) / steps / 1e3,
                             by_cat={k: round(v, 3) for k, v in sums.most_common()},
                             top=[(k, round(v, 3)) for k, v in kern.most_common(25)])
        if rank == 0:
            print(label, json.dumps({k: v for k, v in report[label].items() if k != "top"}),
                  flush=True)
        m = None
        torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "tp_prof.json"), "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(2, 29512, sys.argv[1]), nprocs=2, join=True)
