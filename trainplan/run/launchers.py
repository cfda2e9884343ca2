"""Launch files for a planned layout on the schedulers users already have: a torchrun command on
every node, a SLURM sbatch script, a SkyPilot task YAML, a Kubeflow Trainer v2 TrainJob.

Each file only starts `trainplan train` under torchrun on every node; the engine is the same one
that runs on a single machine. Text only: no scheduler library is imported here (they are the
optional `launch` extra, used by the tests to parse what is written)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from trainplan.errors import ConfigError

TARGETS = ("torchrun", "slurm", "skypilot", "trainjob")
RDZV_PORT = 29500
# SLURM sends SIGUSR1 to the batch script this long before the time limit: enough for the ranks to
# finish the step they are in and write a checkpoint (trainplan stops at a step boundary on SIGTERM)
SLURM_SIGNAL_LEAD_S = 300
# trainplan's device names -> SkyPilot's accelerator names (`sky show-gpus`)
SKYPILOT_ACCELERATORS = {
    "A100-40GB": "A100",
    "A100-80GB": "A100-80GB",
    "H100-80GB": "H100",
    "H200-141GB": "H200",
    "L4": "L4",
    "A10G": "A10G",
    "RTX3090": "RTX3090",
    "RTX4090": "RTX4090",
    "V100-16GB": "V100",
    "V100-32GB": "V100-32GB",
    "T4": "T4",
    "MI300X": "MI300X",
}
K8S_GPU_RESOURCE = {"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where the ranks of one planned job go: `nodes` x `ranks_per_node`, all of one kind."""

    nodes: int
    ranks_per_node: int
    devices: tuple[str, ...]  # trainplan device names, one per rank, as the plan has them
    kind: str  # cuda | rocm | cpu
    name: str  # job name: lowercase letters, digits and '-'
    train_args: tuple[str, ...]  # the arguments of `trainplan train` on every rank
    header: tuple[str, ...]  # comment lines: the plan's verdict and peaks
    checkpoint_dir: str  # checkpoint.dir, or train.output_dir that holds checkpoints/
    image: str | None = None  # container image (TrainJob)
    port: int = RDZV_PORT  # the rendezvous port on the first node

    def __post_init__(self) -> None:
        """Every string written into a launch file stays on its line: a newline or another control
        character in a path, a name or a --set value would end a comment (or a command) and start a
        line that every node runs. The commands quote the rest with shlex (`_train_command`)."""
        field = "config"
        for arg in self.train_args:
            one_line(field, arg)
            field = arg if arg.startswith("--") else "config"
        for line in self.header:
            one_line("the launch file's header (model source or config path)", line)
        one_line("checkpoint.dir", self.checkpoint_dir)
        one_line("--name", self.name)
        if self.image is not None:
            one_line("--image", self.image)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def one_line(field: str, text: str) -> None:
    """Refuse a string that would not stay on its line of a launch file."""
    match = _CONTROL.search(text)
    if match:
        shown = ascii(text)[:120] + ("..." if len(ascii(text)) > 120 else "")
        raise ConfigError(
            field,
            f"holds a newline or control character ({ascii(match.group())} in {shown})",
            "a launch file writes it into a shell line, where it would start a command of its own: remove it",
        )


def split_nodes(world_size: int, nodes: int | None, ranks_per_node: int | None, gpus: str) -> tuple[int, int]:
    """(nodes, ranks per node) for a plan of `world_size` ranks: what was given, the rest derived
    (8 per node when neither is given and 8 divides the world, else one node)."""
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", ranks_per_node)):
        if value is not None and value < 1:
            raise ConfigError(flag, f"must be at least 1 (got {value})", f"e.g. {flag} 2")
    if nodes is None and ranks_per_node is None:
        ranks_per_node = 8 if world_size % 8 == 0 else world_size
    if nodes is None:
        nodes = world_size // ranks_per_node if world_size % ranks_per_node == 0 else 0
    if ranks_per_node is None:
        ranks_per_node = world_size // nodes if world_size % nodes == 0 else 0
    if nodes * ranks_per_node != world_size:
        given = f"{nodes} nodes" if ranks_per_node == 0 else f"{ranks_per_node} per node"
        if nodes and ranks_per_node:
            given = f"{nodes} nodes x {ranks_per_node} per node = {nodes * ranks_per_node} ranks"
        raise ConfigError(
            "--nodes / --gpus-per-node",
            f"{given} does not make the plan's world size of {world_size} (hardware.gpus = {gpus!r})",
            f"give nodes x gpus-per-node = {world_size} (e.g. {_example_split(world_size)}), "
            "or plan the job's devices with --gpus, e.g. --gpus 16xH100-80GB",
        )
    return nodes, ranks_per_node


def _example_split(world_size: int) -> str:
    per_node = next(g for g in (8, 4, 2, 1) if world_size % g == 0)
    return f"--nodes {world_size // per_node} --gpus-per-node {per_node}"


def job_name(text: str) -> str:
    """A name every scheduler takes (a Kubernetes DNS-1123 label): lowercase, digits, '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    return name or "trainplan"


def render(target: str, layout: Layout) -> str:
    """The launch file for `target`, starting with the plan's comment lines."""
    if layout.kind == "cpu" and target in ("skypilot", "trainjob"):
        raise ConfigError(
            "--target",
            f"{target} launches GPU nodes, but the plan is for CPU ranks (hardware.gpus is CPU)",
            "plan the job's GPUs with --gpus (e.g. --gpus 16xH100-80GB), or use --target torchrun or slurm for CPU",
        )
    head = "".join(f"# {line}\n" for line in layout.header)
    body = {"torchrun": _torchrun, "slurm": _slurm, "skypilot": _skypilot, "trainjob": _trainjob}[target](layout)
    if body.startswith("#!"):  # the interpreter line stays first
        shebang, rest = body.split("\n", 1)
        return f"{shebang}\n{head}{rest}"
    return head + body


def _train_command(layout: Layout) -> str:
    return " ".join(shlex.quote(a) for a in ("-m", "trainplan", "train", *layout.train_args))


def _torchrun_flags(*, nnodes: str, nproc: str, endpoint: str, rdzv_id: str) -> str:
    return (
        f"--nnodes={nnodes} --nproc-per-node={nproc} --rdzv-backend=c10d --rdzv-endpoint={endpoint} --rdzv-id={rdzv_id}"
    )


def _torchrun(layout: Layout) -> str:
    flags = _torchrun_flags(
        nnodes=str(layout.nodes),
        nproc=str(layout.ranks_per_node),
        endpoint=f'"$MASTER_ADDR:{layout.port}"',
        rdzv_id=layout.name,
    )
    return f"""#!/usr/bin/env bash
# Run this same script on each of the {layout.nodes} nodes, with MASTER_ADDR set to one node's address that
# every node reaches (that node hosts the c10d rendezvous on port {layout.port}); ranks are assigned by the
# rendezvous. A job restarted after a failure resumes from the newest valid checkpoint (checkpoint.resume=auto).
set -euo pipefail
: "${{MASTER_ADDR:?set MASTER_ADDR to the address of the node that hosts the rendezvous}}"
exec torchrun {flags} \\
    {_train_command(layout)}
"""


def _slurm(layout: Layout) -> str:
    gpus = f"#SBATCH --gpus-per-node={layout.ranks_per_node}\n" if layout.kind != "cpu" else ""
    flags = _torchrun_flags(
        nnodes=str(layout.nodes),
        nproc=str(layout.ranks_per_node),
        endpoint=f'"$MASTER_ADDR:{layout.port}"',
        rdzv_id='"$SLURM_JOB_ID"',
    )
    return f"""#!/bin/bash
#SBATCH --job-name={layout.name}
#SBATCH --nodes={layout.nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --requeue
#SBATCH --signal=B:USR1@{SLURM_SIGNAL_LEAD_S}
#SBATCH --open-mode=append
#SBATCH --output={layout.name}-%j.out
# Add the --partition, --account and --time your cluster needs. One task per node runs torchrun, which
# starts {layout.ranks_per_node} rank(s) there. {layout.checkpoint_dir} must be on a filesystem every node shares.
set -euo pipefail
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
export MASTER_ADDR="${{nodes[0]}}"  # the first node hosts the c10d rendezvous

# Before the time limit SLURM sends USR1 to this script: stop the ranks with SIGTERM (trainplan
# finishes its step and writes a checkpoint), then requeue; the requeued job resumes from the newest
# valid checkpoint (checkpoint.resume=auto). A preemption requeues the job itself (--requeue).
requeue() {{
    echo "trainplan: time limit near: checkpointing and requeueing job $SLURM_JOB_ID" >&2
    kill -TERM "$srun_pid" 2>/dev/null || true
    wait "$srun_pid" || true
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}}
trap requeue USR1

srun --kill-on-bad-exit=1 torchrun {flags} \\
    {_train_command(layout)} &
srun_pid=$!
wait "$srun_pid"
"""


def _q(text: str) -> str:
    """A YAML double-quoted scalar (JSON's string syntax is YAML's)."""
    return json.dumps(text)


def _one_device(layout: Layout, target: str) -> str:
    names = sorted(set(layout.devices))
    if len(names) != 1:
        raise ConfigError(
            "hardware.gpus",
            f"{target} asks for one accelerator type per node, but the plan mixes {', '.join(names)}",
            "plan one kind of GPU, e.g. --gpus 16xH100-80GB",
        )
    return names[0]


def _skypilot(layout: Layout) -> str:
    device = _one_device(layout, "skypilot")
    accelerator = SKYPILOT_ACCELERATORS.get(device)
    if accelerator is None:
        raise ConfigError(
            "hardware.gpus",
            f"{device!r} has no SkyPilot accelerator name",
            f"name the GPU model, one of {', '.join(SKYPILOT_ACCELERATORS)}, e.g. --gpus 16xH100-80GB",
        )
    # SkyPilot's own pattern: a static rendezvous whose node ranks are SkyPilot's (node 0 is the head)
    flags = (
        f'--nnodes="$SKYPILOT_NUM_NODES" --nproc-per-node={layout.ranks_per_node} --node-rank="$SKYPILOT_NODE_RANK" '
        f'--master-addr="$MASTER_ADDR" --master-port={layout.port}'
    )
    run = (
        'MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"  # the head node\n'
        f"torchrun {flags} \\\n    {_train_command(layout)}\n"
    )
    run_block = "".join(f"  {line}\n" for line in ["set -euo pipefail", *run.splitlines()])
    return f"""name: {layout.name}
num_nodes: {layout.nodes}
resources:
  accelerators: {accelerator}:{layout.ranks_per_node}
# The working directory is synced to every node: the config and data paths are relative to it.
# Install trainplan there in a `setup:` block (e.g. pip install -e '.[run]') unless the image has it.
workdir: .
# Checkpoints must be on storage every node shares and that a recovered job finds again (the newest
# valid one is resumed: checkpoint.resume=auto). Mount it at {layout.checkpoint_dir}, e.g.
# file_mounts:
#   {layout.checkpoint_dir}:
#     source: s3://my-bucket/{layout.name}
#     mode: MOUNT_CACHED
# or, on Kubernetes, a SkyPilot volume (`volumes:`) backed by a ReadWriteMany claim.
run: |
{run_block}"""


def _trainjob(layout: Layout) -> str:
    _one_device(layout, "trainjob")
    resource = K8S_GPU_RESOURCE[layout.kind]
    # The torch-distributed runtime sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR
    # and PET_MASTER_PORT on every node; torchrun reads them.
    command = ["torchrun", *shlex.split(_train_command(layout))]
    image = f"    image: {_q(layout.image)}\n" if layout.image else ""
    return f"""# The image must have trainplan installed and the config at the path below (without --image, the
# runtime's own image, which does not). {layout.checkpoint_dir} must be a ReadWriteMany volume mounted on
# every node (add it with the runtime's podTemplateOverrides): a restarted pod resumes from the newest valid
# checkpoint there (checkpoint.resume=auto).
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata:
  name: {layout.name}
spec:
  runtimeRef:
    name: torch-distributed
  trainer:
{image}    numNodes: {layout.nodes}
    numProcPerNode: {layout.ranks_per_node}
    command: [{", ".join(_q(c) for c in command)}]
    resourcesPerNode:
      limits:
        {resource}: {layout.ranks_per_node}
"""
