"""resa's decode kernels launched alone at the Qwen3-1.7B shape at 128K, each twice (compile, then the launch to
read), for Nsight Compute on a GPU:

    ncu --clock-control none --set full --import-source no \
        -k regex:"_fused_select_kernel|_sparse_decode_fwd_kernel|_lse_combine_kernel|_gemv_fwd_kernel" \
        --launch-count 20 -f -o resa_kernels python benchmarks/resa_kernels_once.py

The one-launch selection over int8 descriptors (softmax pooling, centroid folded, 1,024 blocks kept of 8,200),
the sparse attention over its blocks with the split merge, and the layer's four projections as the decode step
runs them (norm folded into q/k/v and gate/up, SiLU gate, residual in down). Random data: for where the kernels'
time goes, not for answers.
"""
import torch
from kernels.block_select import KeepRule, new_histogram, new_sync, select_blocks
from kernels.sparse_decode_attention import sparse_decode_attention
from kernels.gemv import gemv
torch.manual_seed(0)
dev = "cuda"
B, Hkv, group, D, NB = 1, 8, 2, 128, 8200
L = 131072 + 40
q = torch.randn(B, Hkv * group, D, device=dev, dtype=torch.bfloat16)
kmax = torch.randint(-127, 128, (B, Hkv, NB, D), device=dev, dtype=torch.int8)
kmin = torch.minimum(kmax, torch.randint(-127, 128, (B, Hkv, NB, D), device=dev, dtype=torch.int8))
kmax = torch.maximum(kmax, kmin)
scale = torch.rand(B, Hkv, NB, device=dev) * 0.01
length = torch.tensor([L], device=dev)
rule = KeepRule(0.1, 1024, 1, 1, pooling="softmax", centroid=True)
kw = dict(block_size=16, rule=rule, width=rule.keep(NB), scale=D ** -0.5, folded=True, descriptor_scale=scale,
          histogram=new_histogram(B, Hkv, dev), sync=new_sync(B, Hkv, dev))
for _ in range(2):
    blocks = select_blocks(q, kmax, kmin, length, **kw)
torch.cuda.synchronize()
S_cap = L + 200
k = torch.randn(B, Hkv, S_cap, D, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
for _ in range(2):
    sparse_decode_attention(q, k, v, blocks.view(B, Hkv, -1), length, block_size=16, scale=D ** -0.5)
torch.cuda.synchronize()
H, I = 2048, 6144
x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
g = torch.ones(H, device=dev, dtype=torch.bfloat16)
for name, (n, kdim, extra) in {"qkv": (4096, H, dict(norm=(g, 1e-6))), "o": (H, H, {}),
                               "gate_up": (2 * I, H, dict(norm=(g, 1e-6), act="silu")),
                               "down": (H, I, dict(residual=x.clone()))}.items():
    w = torch.randn(n, kdim, device=dev, dtype=torch.bfloat16) * 0.02
    xi = torch.randn(1, kdim, device=dev, dtype=torch.bfloat16)
    for _ in range(2):
        gemv(xi, w, **extra)
torch.cuda.synchronize()
print("done", blocks.shape)
