"""One rank of a pipeline, run under torchrun by tests/run/test_pipeline_parallel.py (not a test file).

It loads the model and the steps' micro-batches the test wrote under ROOT, cuts the model to this rank's
stage, runs the steps through the engine's 1F1B pipeline, and writes each step's loss and gradient norm
and the trained model's held-out metric through the stages (ROOT/steps.json, from rank 0), its stage's
final weights (ROOT/stage<rank>.safetensors) and a DCP checkpoint of every stage's weights and optimizer
state, as the engine's checkpoints hold them (ROOT/ckpt/dcp)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file, save_file

from trainplan.features.pipeline_parallel.engine import Pipeline, cut
from trainplan.run import attention, evaluate, loss, measure, step
from trainplan.run.checkpoint.format import _dcp_state
from trainplan.spec.parallel import ParallelDims
from trainplan.spec.precision import PRECISIONS


def main(root: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = json.loads((root / "spec.json").read_text())
    attention.register()  # the rows pack documents: attention as train runs it on them, a document a call
    model = transformers.AutoModelForCausalLM.from_pretrained(
        root / "model", dtype=torch.float32, attn_implementation=attention.IMPLEMENTATION
    ).train()
    loss.install(model, spec["chunk_tokens"])
    pp = dist.get_world_size()
    dims = ParallelDims(world_size=pp, dp=1, tp=1, pp=pp, strategy="single")
    pipe = Pipeline(cut(model, dims, dims.coords(rank)[0]), dims, rank, spec["accum"], "cpu")
    optimizer = step.build_optimizer(pipe.model, "adamw", "auto", spec["lr"], 0.0, "cpu")
    settings = step.StepSettings(prec=PRECISIONS["fp32"], device_type="cpu", max_grad_norm=spec["max_grad_norm"])
    batches = load_file(root / "batches.safetensors")
    steps = []
    for s in range(spec["steps"]):
        micro = [{k: batches[f"{s}.{j}.{k}"] for k in spec["keys"]} for j in range(spec["accum"])]
        res = pipe.step(step.Update(optimizer), micro, settings)
        steps.append({"loss": float(res.loss), "grad_norm": float(res.grad_norm), "tokens": res.tokens})
    save_file({k: v.contiguous() for k, v in pipe.model.state_dict().items()}, root / f"stage{rank}.safetensors")
    dcp.save(_dcp_state(pipe.model, optimizer), checkpoint_id=str(root / "ckpt" / "dcp"))
    # the receive buffers the stage keeps for the run, one per micro-batch (the plan's comm_buffers)
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sum(b.numel() * b.element_size() for b in pipe.receive_buffers()))
    # the guard says skip (every stage sees the same loss and norm): nothing moves on any stage
    before = {k: v.clone() for k, v in pipe.model.state_dict().items()}
    # measured (the storage tracker, given the stage's receive buffers): its 1F1B part is one phase
    inputs = [t for mb in micro for t in mb.values()]
    meter = measure.StepMeter(
        pipe.model, optimizer, inputs, torch.device("cpu"), lora=False, comm=pipe.receive_buffers()
    )
    hooks = step.StepHooks(decide=lambda loss, norm, scale: False, on_phase=meter.on_phase)
    with meter:
        skipped = pipe.step(step.Update(optimizer), micro, settings, hooks=hooks)
    measured = [None] * dist.get_world_size()
    dist.all_gather_object(measured, meter.result()["phases"]["1f1b"])
    unchanged = all(torch.equal(v, before[k]) for k, v in pipe.model.state_dict().items())
    unchanged = torch.tensor(float(unchanged and not skipped.applied))
    dist.all_reduce(unchanged, op=dist.ReduceOp.MIN)
    held_out = {k: batches[f"eval.{k}"] for k in ("input_ids", "labels", "position_ids")}
    metrics = evaluate.evaluate(
        pipe.model,
        held_out["input_ids"],
        held_out["labels"],
        positions=held_out["position_ids"],
        micro_batch=spec["eval_micro_batch"],
        max_batches=0,
        prec=settings.prec,
        device=torch.device("cpu"),
        pipeline=pipe,
    )
    if rank == 0:
        doc = {"steps": steps, "eval": metrics, "skip_changed_nothing": bool(unchanged), "receive_buffers": held}
        doc["step_measured"] = measured
        (root / "steps.json").write_text(json.dumps(doc))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
