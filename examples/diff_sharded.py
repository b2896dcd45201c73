"""A tensor-parallel Llama against its single-process reference, site by site: every rank runs this script.

    torchrun --nproc-per-node 2 examples/diff_sharded.py              # CPU (gloo), or one GPU per rank (NCCL)
    torchrun --nproc-per-node 2 examples/diff_sharded.py --fault      # one norm's statistics over its shard only

Each rank builds the same reference (seeded), a copy sharded with ``parallelize_module`` (query/key/value/gate/up
column-wise, output/down row-wise) and calls ``normscope.diff``; rank 0 prints the result. With ``--fault`` the
second layer's post-attention norm computes its statistics over this rank's half of the features (its γ sharded
with them): the diff names that norm.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import normscope


class LocalStatsRMSNorm(torch.nn.Module):
    """The fault: an RMSNorm whose γ is sharded with the features and whose mean square covers this rank's half."""

    def __init__(self, norm, mesh):
        super().__init__()
        self.mesh, self.eps = mesh, norm.variance_epsilon
        self.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Shard(0)]))

    def forward(self, x):
        xs = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(self.mesh, [Shard(-1)])
        xs = xs.to_local()
        y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to_local()
        y = DTensor.from_local(y, self.mesh, [Shard(-1)], run_check=False)
        return y.redistribute(self.mesh, [Replicate()]).to_local()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fault", action="store_true", help="one norm's statistics over its shard only")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)  # the same reference on every rank (diff checks it)
    reference = transformers.LlamaForCausalLM(config).to(device).eval()
    candidate = copy.deepcopy(reference)
    plan = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(candidate, mesh, plan)
    if args.fault:
        layer = candidate.model.layers[1]
        layer.post_attention_layernorm = LocalStatsRMSNorm(layer.post_attention_layernorm, mesh)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    result = normscope.diff(reference, candidate, {"input_ids": ids}, progress=False)
    if rank == 0:
        print(f"{result.candidate}: {result.verdict.upper()}")
        print(result.summary())
    dist.barrier()
    if cuda:  # gloo's destroy_process_group can abort a process that has finished its work
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
