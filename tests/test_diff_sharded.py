"""``diff`` against a candidate run sharded over the ranks of a gloo process group on the CPU: tensor parallelism
with DTensor (``parallelize_module``: query/key/value/gate/up column-wise, output/down row-wise), the same with
sequence parallelism (norms, residual stream and embedding output split along the sequence) and FSDP2
(``fully_shard`` per decoder layer and at the root), every rank holding the single-process reference.

The property over generated cases (architectures × sharding × faults): a clean sharded run is a PASS — every
site's output mapped back from the ranks' pieces, every module's own error within float rounding though the
collectives sum in another order; a candidate cast to bfloat16 before it is sharded within its twin's bound — and a
fault is named at its site: a norm whose statistics cover this rank's half of the features (its γ sharded with
them), an ε changed in one norm, a weight scaled in one projection. The
two ranks are started by the test, as the tracer's distributed tests do.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

ARCHITECTURES = ("llama", "qwen3")
CASES = [("tp", "clean"), ("tp", "local_stats"), ("tp", "norm_eps"), ("tp", "weight"), ("tp", "bf16"),
         ("sp", "clean"), ("sp", "norm_eps"), ("sp", "weight"),
         ("fsdp", "clean"), ("fsdp", "norm_eps"), ("fsdp", "weight"), ("fsdp", "bf16_norm_eps")]

RANK = textwrap.dedent("""
    import copy, json, os, sys
    import torch, torch.distributed as dist
    rank, out, port, world = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[6])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import transformers
    transformers.logging.set_verbosity_error()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    import normscope

    if world == 4:  # data parallel (FSDP2) over tensor parallel: a mesh of two dimensions
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh, dp_mesh = grid["tp"], grid["dp"]
    else:
        mesh = dp_mesh = init_device_mesh("cpu", (world,))
    SIZE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    CONFIGS = {"llama": lambda: transformers.LlamaConfig(**SIZE),
               "qwen3": lambda: transformers.Qwen3Config(**SIZE, head_dim=8)}


    class LocalStats(torch.nn.Module):
        '''An RMSNorm whose γ is sharded with the features and whose statistics cover this rank's half of them.'''

        def __init__(self, norm):
            super().__init__()
            self.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Shard(0)]))
            self.eps = norm.variance_epsilon

        def forward(self, x):
            xs = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(-1)])
            xs = xs.to_local()
            y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to_local()
            return DTensor.from_local(y, mesh, [Shard(-1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


    def tensor_parallel(model):
        plan = {}
        for i, _ in enumerate(model.model.layers):
            p = f"model.layers.{i}."
            plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                         p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                         p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                         p + "mlp.down_proj": RowwiseParallel()})
        return parallelize_module(model, mesh, plan)


    def sequence_parallel(model):
        '''Tensor parallel with the norms, the residual stream and the embedding's output split along the sequence
        (a row-wise embedding, whose partial sum holds a mask).'''
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                      use_local_output=False),
                "model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        for i, _ in enumerate(model.model.layers):
            p = f"model.layers.{i}."
            plan.update({
                p + "input_layernorm": SequenceParallel(), p + "post_attention_layernorm": SequenceParallel(),
                p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                p + "self_attn.v_proj": ColwiseParallel(),
                p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
        return parallelize_module(model, mesh, plan)


    def fsdp(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model


    results = []
    for arch in sys.argv[4].split(","):
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation="eager").eval()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.2)
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
        for sharding, fault in json.loads(sys.argv[5]):
            cand, site = copy.deepcopy(ref), None
            if fault.startswith("bf16"):  # the candidate cast to bfloat16 before it is sharded
                cand = cand.to(torch.bfloat16)
            layer = cand.model.layers[1]
            if fault.endswith("norm_eps"):
                layer.input_layernorm.variance_epsilon = 0.5
                site = "model.layers.1.input_layernorm"
            elif fault == "weight":
                with torch.no_grad():
                    layer.mlp.up_proj.weight[:8].mul_(1.5)
                site = "model.layers.1.mlp.up_proj"
            {"tp": tensor_parallel, "sp": sequence_parallel, "fsdp": fsdp,
             "fsdp_tp": lambda m: fsdp(tensor_parallel(m))}[sharding](cand)
            if fault == "local_stats":
                layer.post_attention_layernorm = LocalStats(layer.post_attention_layernorm)
                site = "model.layers.1.post_attention_layernorm"
            d = normscope.diff(ref, cand, {"input_ids": ids}, progress=False)
            results.append({"arch": arch, "sharding": sharding, "fault": fault, "site": site,
                            "verdict": d.verdict, "first": d.first_divergence, "summary": d.summary(),
                            "candidate": d.candidate, "own": sum(s.own is not None for s in d.sites),
                            "sites": len(d.sites), "notes": d.notes,
                            "max_own": max((s.own["normalized"] for s in d.sites
                                            if s.own and s.status == "within"), default=0.0)})
    # what a sharded candidate refuses, the same on every rank
    errors = {}
    cand = tensor_parallel(copy.deepcopy(ref))
    other = copy.deepcopy(ref)
    with torch.no_grad():
        other.lm_head.weight.add_(rank)  # the other ranks' references are other models
    for what, call in (("grad", lambda: normscope.diff(ref, cand, {"input_ids": ids}, grad=True, progress=False)),
                       ("dtype", lambda: normscope.diff(ref, cand, {"input_ids": ids}, candidate_dtype="bfloat16",
                                                        progress=False)),
                       ("reference", lambda: normscope.diff(other, cand, {"input_ids": ids}, progress=False))):
        try:
            call()
            errors[what] = None
        except normscope.NormscopeError as exc:
            errors[what] = str(exc)
    results.append({"errors": errors})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
""")


def _ranks(out: Path, archs, cases, world: int = 2) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(out), port, ",".join(archs), json.dumps(cases),
                               str(world)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(err[-3000:] for _, err in logs)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _ranks(tmp_path_factory.mktemp("sharded") / "results.json", ARCHITECTURES, CASES)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(("sharding", "fault"), CASES)
def test_sharded_candidate_property(results, arch, sharding, fault):
    r = next(r for r in results if (r.get("arch"), r.get("sharding"), r.get("fault")) == (arch, sharding, fault))
    assert f"sharded over 2 ranks ({'FSDP2' if sharding == 'fsdp' else 'tensor parallel'})" in r["candidate"]
    if r["site"] is None:
        assert r["verdict"] == "pass", r["summary"]
        assert r["own"] >= 0.8 * r["sites"], r  # every module judged on its own code, not only leaves
        if fault == "bf16":  # judged against the reference at bfloat16 (the twin), as an unsharded candidate is
            assert "at bfloat16" in r["summary"] and r["max_own"] > 1e-4, r
        else:
            assert r["max_own"] < 1e-5, r  # the collectives' other summation order: float rounding
    else:
        assert r["verdict"] == "fail" and r["first"] == r["site"], (r["site"], r["summary"])


def test_sharded_candidate_refusals(results):
    errors = next(r["errors"] for r in results if "errors" in r)
    assert errors["grad"] and "grad=True with a sharded candidate" in errors["grad"]
    assert "a sharded candidate runs as its ranks hold it" in errors["dtype"]
    assert "the reference differs across the 2 ranks" in errors["reference"]


def test_two_dimensional_mesh(tmp_path):
    """Four ranks: FSDP2 over a data-parallel dimension of tensor-parallel pairs. A plain output's pieces come from
    both pairs (the same pieces twice); a teacher-forced input is this rank's piece within its pair."""
    results = _ranks(tmp_path / "results.json", ("llama",), [("fsdp_tp", "clean"), ("fsdp_tp", "norm_eps")], world=4)
    clean, eps = (r for r in results if "fault" in r)
    assert "sharded over 4 ranks (FSDP2 and tensor parallel)" in clean["candidate"]
    assert clean["verdict"] == "pass" and clean["max_own"] < 1e-5, clean["summary"]
    assert eps["verdict"] == "fail" and eps["first"] == eps["site"], eps["summary"]


def test_assemble_places_the_pieces_by_the_reference_shape():
    from normscope.divergence.sharded import assemble

    x = torch.arange(24.0).reshape(2, 3, 4)
    assert assemble([x, x.clone()], (2, 3, 4))[1] == "replicated"
    full, how = assemble(list(torch.chunk(x, 2, -1)), (2, 3, 4))
    assert how == "sharded on dim 2" and torch.equal(full, x)
    full, how = assemble([*torch.chunk(x, 2, 0)] * 2, (2, 3, 4))  # two groups of a 2-D mesh: the pieces twice
    assert how == "sharded on dim 0" and torch.equal(full, x)
    full, how = assemble([x, x + 1], (2, 3, 4))  # a sum left unreduced: rank 0's, and it fails
    assert how.startswith("different on each rank") and torch.equal(full, x)
    assert assemble([x[:, :1], x[:, :1] + 1], (2, 3, 4))[1].startswith("pieces of shape [2, 1, 4]")
