"""TP=1 vs TP=2 GEMM shapes of the gpu2 MLP (issue #26), one GPU: TFLOP/s per operand layout
(weight [out, in] as F.linear or [in, out] as the TP layers; weight gradient or its transpose),
cuBLAS default and cuBLASLt. `python benchmarks/tp_gemm_shapes.py OUT.json`; results in
`benchmarks/results/tp_gemm_shapes_h200.json`."""
import json
import sys

import torch
from triton.testing import do_bench

T, d, F = 8192, 8192, 32768
torch.manual_seed(0)
dev = "cuda"
rows = []
def bench(name, a, b, f, flops):
    ms = do_bench(lambda: f(a, b), warmup=50, rep=300)
    rows.append((name, round(ms, 4), round(flops / ms / 1e9, 1)))
    print(*rows[-1], flush=True)
for lib in ("default", "cublaslt"):
    if lib == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    for f in (F, F // 2):
        x = torch.randn(T, d, device=dev, dtype=torch.bfloat16)
        h = torch.randn(T, f, device=dev, dtype=torch.bfloat16)
        w1 = torch.randn(f, d, device=dev, dtype=torch.bfloat16)   # fc1 weight [out, in]
        w2 = torch.randn(d, f, device=dev, dtype=torch.bfloat16)   # fc2 weight [out, in]
        fl1 = 2 * T * d * f
        tag = f"{lib} f={f}"
        # forward as F.linear (x @ W^T) and with the weight stored [in, out] (x @ W)
        bench(f"{tag} fc1 fwd x@W1^T", x, w1, lambda a, b: a @ b.t(), fl1)
        bench(f"{tag} fc1 fwd x@W1t", x, w1.t().contiguous(), lambda a, b: a @ b, fl1)
        bench(f"{tag} fc2 fwd h@W2^T", h, w2, lambda a, b: a @ b.t(), fl1)
        bench(f"{tag} fc2 fwd h@W2t", h, w2.t().contiguous(), lambda a, b: a @ b, fl1)
        # input grads
        bench(f"{tag} fc1 dx dh@W1", h, w1, lambda a, b: a @ b, fl1)
        bench(f"{tag} fc1 dx dh@W1t^T", h, w1.t().contiguous(), lambda a, b: a @ b.t(), fl1)
        bench(f"{tag} fc2 dx dy@W2", x, w2, lambda a, b: a @ b, fl1)
        bench(f"{tag} fc2 dx dy@W2t^T", x, w2.t().contiguous(), lambda a, b: a @ b.t(), fl1)
        # weight grads: dW1 = dh^T x [f, d]; dW2 = dy^T h [d, f]; or their transposes
        bench(f"{tag} fc1 dW dh^T@x", h, x, lambda a, b: a.t() @ b, fl1)
        bench(f"{tag} fc1 dWt x^T@dh", x, h, lambda a, b: a.t() @ b, fl1)
        bench(f"{tag} fc2 dW dy^T@h", x, h, lambda a, b: a.t() @ b, fl1)
        bench(f"{tag} fc2 dWt h^T@dy", h, x, lambda a, b: a.t() @ b, fl1)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
