"""FSDP2 with a sparse cross-replica reduce (HSDP: shard within a node, replicate across nodes).

    torchrun --standalone --nproc_per_node 4 examples/fsdp_hsdp_sparse.py   # a 2 x 2 mesh

Ranks {0,1} and {2,3} each hold one sharded replica (the "shard" dimension: a node's GPUs);
ranks 0 and 2, and 1 and 3, hold the same shard and reduce it sparsely across the "replicate"
dimension (the inter-node link). With 2 ranks: 2 replicas of an unsharded model. CPU/gloo here;
on GPUs the mesh is built on "cuda". Each run trains afresh and saves every rank's state.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import oktopk_triton
from oktopk_triton.integrations.fsdp import SparseReplicaReduce


def main():
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = int(os.environ["WORLD_SIZE"])
    shard = 2 if world >= 4 and world % 2 == 0 else 1     # 2 ranks: 2 unsharded replicas
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // shard, shard),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])            # 1-D: the hook does the replicas
    fully_shard(model, mesh=mesh["shard"])
    sparse = SparseReplicaReduce(mesh["replicate"].get_group(), density=0.01).install(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    device = "cuda" if cuda else "cpu"
    g = torch.Generator().manual_seed(dist.get_rank())
    w = torch.randn(20, 10, generator=torch.Generator().manual_seed(0))
    for step in range(60):
        x = torch.randn(32, 20, generator=g)
        y = (x @ w).argmax(1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        if step % 20 == 19 and dist.get_rank() == 0:
            # HSDP's dense all-reduce (a ring over R replicas): 2(R-1)/R x the shard's bytes
            R = mesh["replicate"].size()
            shard = sum(r.numel for r in sparse.reducers.values())
            dense = (step + 1) * 2 * (R - 1) / R * 4 * shard
            print(f"step {step + 1} loss {loss.item():.4f}; rank 0 sent "
                  f"{sparse.total_bytes_sent / 1e3:.1f} kB across replicas (dense: "
                  f"{dense / 1e3:.1f} kB)")
    sparse.save("out/fsdp-sparse")       # one file per rank; sparse.load(dir) resumes


if __name__ == "__main__":
    main()
    oktopk_triton.shutdown(exit_code=0)  # barrier, destroy the group, leave (no gloo abort)
