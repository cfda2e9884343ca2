"""`trainplan launch`: each target's file for a layout that fits, read back by its own ecosystem's
parser (torchrun's, SkyPilot's, the Kubeflow SDK's models, submitit's sbatch writer); a layout that
does not fit, or does not divide into the nodes given, is refused with nothing written.

The schedulers' parsers are the optional `launch` extra (`make launch-extras`); a test that needs
one skips, saying which, where it is missing."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from trainplan import cli
from trainplan.commands._common import config_from_args

EXAMPLE = Path(__file__).resolve().parents[1] / "trainplan" / "examples" / "full-llama8b-zero3.toml"
SHARED = "/shared/runs/llama8b"
# the example (8xH100) planned for two 8-GPU nodes
TWO_NODES = [str(EXAMPLE), "--gpus", "16xH100-80GB", "--set", f"train.output_dir={SHARED}"]


def launch(tmp_path, target: str, *args: str) -> tuple[int, Path]:
    out = tmp_path / f"launch-{target}"
    code = cli.main(["launch", *args, "--target", target, "-o", str(out)])
    return code, out


def written(tmp_path, target: str, *args: str) -> str:
    code, out = launch(tmp_path, target, *TWO_NODES, "--nodes", "2", "--gpus-per-node", "8", *args)
    assert code == 0
    text = out.read_text()
    head = [line for line in text.splitlines() if line.startswith("# ")]
    assert any(line.startswith("# plan (analytic): FITS on every device") for line in head), head
    assert any(re.match(r"# planned peak on H100-80GB: [\d.]+ GiB of 79.65 GiB usable", line) for line in head), head
    return text


def torchrun_argv(script: str, env: dict[str, str]) -> list[str]:
    """The arguments of the one torchrun line in a shell script, its variables filled in."""
    text = script.replace("\\\n", " ")
    line = next(x for x in text.splitlines() if re.search(r"(^|\s)torchrun\s", x) and not x.lstrip().startswith("#"))
    for name, value in env.items():
        line = line.replace(f"${name}", value)
    assert "$" not in line, line
    words = shlex.split(line)
    words = words[words.index("torchrun") + 1 :]
    return words[:-1] if words[-1] == "&" else words


def check_torchrun(argv: list[str], *, nnodes: str) -> None:
    """torchrun's own parser reads the arguments, and trainplan's own parser the training command:
    each rank plans what launch planned (16 H100s, resumed from the newest valid checkpoint)."""
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(argv)
    assert (ns.nnodes, ns.nproc_per_node, ns.module, ns.training_script) == (nnodes, "8", True, "trainplan")
    args = cli.build_parser().parse_args(ns.training_script_args)
    assert args.command == "train"
    cfg = config_from_args(args)
    assert cfg.hardware.gpus == "16xH100-80GB" and cfg.checkpoint.resume == "auto"
    assert cfg.train.output_dir == SHARED and cfg.parallel.strategy == "zero3"


def test_torchrun_command_read_by_torchrun(tmp_path):
    pytest.importorskip("torch", reason="torchrun's argument parser needs torch")
    text = written(tmp_path, "torchrun")
    assert text.startswith("#!/usr/bin/env bash\n# trainplan launch --target torchrun")
    argv = torchrun_argv(text, {"MASTER_ADDR": "10.0.0.1"})
    check_torchrun(argv, nnodes="2")
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(argv)
    assert (ns.rdzv_backend, ns.rdzv_endpoint) == ("c10d", "10.0.0.1:29500")


def test_sbatch_header_is_what_submitit_writes(tmp_path):
    slurm = pytest.importorskip("submitit.slurm.slurm", reason="submitit is not installed (make launch-extras)")
    text = written(tmp_path, "slurm")
    ours = [line for line in text.splitlines() if line.startswith("#SBATCH ")]
    theirs = slurm._make_sbatch_string(
        command="true",
        folder=tmp_path,
        job_name="trainplan-full-llama8b-zero3",
        nodes=2,
        ntasks_per_node=1,
        gpus_per_node=8,
        additional_parameters={
            "requeue": True,
            "signal": "B:USR1@300",
            "output": "trainplan-full-llama8b-zero3-%j.out",
        },
    ).splitlines()
    assert set(ours) <= set(theirs), set(ours) - set(theirs)
    assert "#SBATCH --requeue" in ours and "#SBATCH --gpus-per-node=8" in ours
    # every #SBATCH line comes before the first command, or sbatch ignores it
    first_command = next(i for i, x in enumerate(text.splitlines()) if x and not x.startswith("#"))
    assert max(i for i, x in enumerate(text.splitlines()) if x.startswith("#SBATCH")) < first_command
    pytest.importorskip("torch", reason="torchrun's argument parser needs torch")
    check_torchrun(torchrun_argv(text, {"MASTER_ADDR": "node-a", "SLURM_JOB_ID": "42"}), nnodes="2")


def test_skypilot_task_read_by_skypilot(tmp_path):
    sky = pytest.importorskip("sky", reason="skypilot is not installed (make launch-extras)")
    text = written(tmp_path, "skypilot")
    assert text.startswith("# trainplan launch --target skypilot: 2 node(s) x 8 rank(s) = world 16\n")
    task = sky.Task.from_yaml(str(tmp_path / "launch-skypilot"))
    assert task.num_nodes == 2 and task.name == "trainplan-full-llama8b-zero3"
    assert [r.accelerators for r in task.resources] == [{"H100": 8}]
    assert "SKYPILOT_NODE_IPS" in task.run and task.run.count("--set checkpoint.resume=auto") == 1
    pytest.importorskip("torch", reason="torchrun's argument parser needs torch")
    env = {"MASTER_ADDR": "10.0.0.1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1"}
    argv = torchrun_argv(task.run, env)
    check_torchrun(argv, nnodes="2")
    assert "--node-rank=1" in argv and "--master-addr=10.0.0.1" in argv


def test_trainjob_read_by_the_kubeflow_sdk(tmp_path, monkeypatch):
    models = pytest.importorskip(
        "kubeflow_trainer_api.models", reason="the Kubeflow SDK is not installed (make launch-extras)"
    )
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    written(tmp_path, "trainjob", "--image", "ghcr.io/example/trainplan:0.1")
    doc = yaml.safe_load((tmp_path / "launch-trainjob").read_text())
    job = models.TrainerV1alpha1TrainJob.from_dict(doc)
    assert job.to_dict() == doc  # the SDK's model drops keys it does not know: none was dropped
    assert (job.api_version, job.kind, job.spec.runtime_ref.name) == (
        "trainer.kubeflow.org/v1alpha1",
        "TrainJob",
        "torch-distributed",
    )
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", job.metadata.name)  # a DNS-1123 label
    trainer = job.spec.trainer
    assert (trainer.num_nodes, trainer.num_proc_per_node, trainer.image) == (2, 8, "ghcr.io/example/trainplan:0.1")
    assert trainer.resources_per_node.limits["nvidia.com/gpu"].actual_instance == 8
    pytest.importorskip("torch", reason="torchrun's argument parser needs torch")
    assert trainer.command[0] == "torchrun"
    # the torch-distributed runtime hands numNodes and numProcPerNode to torchrun as PET_* variables
    monkeypatch.setenv("PET_NNODES", str(trainer.num_nodes))
    monkeypatch.setenv("PET_NPROC_PER_NODE", str(trainer.num_proc_per_node))
    check_torchrun(trainer.command[1:], nnodes="2")


def test_a_layout_that_does_not_fit_is_refused_with_the_ledgers_reason(tmp_path, capsys):
    from trainplan.commands import launch as launch_command
    from trainplan.plan.analytic import plan

    args = [str(EXAMPLE), "--gpus", "2xRTX4090", "--set", "train.output_dir=/x"]
    code, out = launch(tmp_path, "slurm", *args)
    err = capsys.readouterr().err
    verdict = plan(config_from_args(cli.build_parser().parse_args(["launch", *args, "--target", "slurm"]))).verdict()
    assert code == 1 and not out.exists() and list(tmp_path.iterdir()) == []
    assert err == f"trainplan launch: {verdict}; nothing written\n" and verdict.startswith("DOES NOT FIT: GPU 0")
    assert launch_command.HELP


@pytest.mark.parametrize(
    "split, said",
    [(["--nodes", "3"], "3 nodes"), (["--nodes", "2", "--gpus-per-node", "4"], "2 nodes x 4 per node = 8 ranks")],
)
def test_nodes_that_do_not_make_the_world_size_are_refused(tmp_path, capsys, split, said):
    code, out = launch(tmp_path, "torchrun", *TWO_NODES, *split)
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists() and len(err.splitlines()) == 1
    assert err.startswith(f"trainplan launch: error: --nodes / --gpus-per-node: {said} does not make")
    assert "world size of 16" in err and "--nodes 2 --gpus-per-node 8" in err


def test_a_cpu_plan_launches_on_slurm_but_not_on_gpu_clouds(tmp_path, capsys):
    cpu = ["--model", "default", "--gpus", "2xcpu", "--set", "train.output_dir=/x"]
    code, out = launch(tmp_path, "slurm", *cpu, "--nodes", "2")
    text = out.read_text()
    assert code == 0 and "#SBATCH --nodes=2" in text and "--gpus-per-node" not in text
    assert "--nproc-per-node=1" in text
    for target in ("skypilot", "trainjob"):
        code, out = launch(tmp_path, target, *cpu)
        assert code == 2 and not out.exists()
        assert f"--target: {target} launches GPU nodes, but the plan is for CPU ranks" in capsys.readouterr().err


def test_a_launch_needs_a_shared_output_dir_and_named_devices(tmp_path, capsys):
    code, _ = launch(tmp_path, "slurm", str(EXAMPLE))
    assert code == 2 and "train.output_dir: is not set" in capsys.readouterr().err
    code, _ = launch(tmp_path, "slurm", str(EXAMPLE), "--gpus", "auto", "--set", "train.output_dir=/x")
    assert code == 2 and "hardware.gpus: is 'auto'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_sbatch_script_runs_under_a_stand_in_slurm_and_requeues_on_usr1(tmp_path):
    """The script itself, run by bash with stand-ins for scontrol and srun: the rendezvous host is the
    first node of the allocation, and the time-limit signal (USR1) stops the ranks and requeues the job."""
    _, script = launch(tmp_path, "slurm", *TWO_NODES)
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then printf "node-a\\nnode-b\\n"; '
        'else echo "$@" >> "$FAKE_LOG/scontrol"; fi\n'
    )
    (bin_dir / "srun").write_text(
        "#!/bin/bash\ntrap 'kill $!; echo TERM > \"$FAKE_LOG/srun.signal\"; exit 143' TERM\n"
        'printf "%s\\n" "$@" > "$FAKE_LOG/srun.args"\nsleep 60 & wait\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_ID": "42",
    }
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (log / "srun.args").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # srun's TERM trap is set before it writes its arguments
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    srun = (log / "srun.args").read_text().splitlines()
    assert srun[:2] == ["--kill-on-bad-exit=1", "torchrun"]
    assert "--rdzv-endpoint=node-a:29500" in srun and "--rdzv-id=42" in srun
    assert (log / "srun.signal").read_text() == "TERM\n"
    assert (log / "scontrol").read_text() == "requeue 42\n"
    assert "checkpointing and requeueing job 42" in err


# ---- the sbatch script under a real SLURM ------------------------------------------------------

SLURM_CONF = """\
ClusterName=trainplan-test
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together while they are chosen)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A one-node SLURM cluster of this machine for the module's tests: slurmctld and slurmd from
    Debian's slurm-wlm packages (`make slurm`), on free ports, with their own state directory; the
    environment (SLURM_CONF) that submits to it. Where it cannot be stood up, the test skips with the reason."""
    import shutil
    import socket

    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} not found; `make slurm` installs it)")
    if os.geteuid() != 0:
        pytest.skip("slurmd starts jobs as their user, so it runs as root, and these tests do not")
    host = socket.gethostname().split(".")[0]
    try:  # the script's rendezvous is on the allocation's first node, by name
        socket.gethostbyname(host)
    except OSError as e:
        pytest.skip(f"this machine's name {host!r} does not resolve ({e}), and the job's rendezvous uses it")
    root = tmp_path_factory.mktemp("slurm")
    (root / "state").mkdir()
    (root / "spool").mkdir()
    ctld_port, d_port = _free_ports(2)
    cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use, as slurmd counts them
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, root=root, ctld_port=ctld_port, d_port=d_port, cpus=cpus))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for key in [k for k in env if k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_NODELIST"))]:
        env.pop(key)  # not this test's own allocation, should it run inside one
    daemons = []
    try:
        for name, extra in (("slurmctld", []), ("slurmd", ["-N", host])):
            with (root / f"{name}.out").open("w") as log:  # the child keeps its own descriptor
                daemons.append(
                    subprocess.Popen(
                        [name, "-D", "-f", str(conf), *extra],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its job steps too: killed as a group below
                    )
                )
        deadline, state = time.monotonic() + 30, ""
        while time.monotonic() < deadline and state != "idle":
            if any(d.poll() is not None for d in daemons):
                break
            got = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, check=False)
            state = got.stdout.strip()
            time.sleep(0.5)
        if state != "idle":
            logs = " | ".join(
                f"{p.name}: {p.read_text().strip().splitlines()[-1]}"
                for p in sorted(root.glob("slurm*.log")) + sorted(root.glob("slurm*.out"))
                if p.exists() and p.read_text().strip()
            )
            pytest.skip(f"the one-node SLURM cluster did not come up (node state {state!r}): {logs}")
        yield env
    finally:
        for cmd in (["scancel", "--full", "--partition", "debug"], ["scontrol", "shutdown"]):
            try:
                subprocess.run(cmd, env=env, capture_output=True, check=False, timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for d in daemons:
            try:
                d.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(d.pid, signal.SIGKILL)
                d.wait()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sbatch_script_completes_under_real_slurm_and_the_run_is_in_the_registry(slurm_cluster, tiny_run, tmp_path):
    """`trainplan launch --target slurm` for one node of two CPU ranks, submitted with sbatch to a real
    slurmctld + slurmd: the job completes, and the registry (the job's home) holds its run."""
    import sys

    from trainplan.verify import registry

    root, base = tiny_run
    shared, home = tmp_path / "shared", tmp_path / "home"
    sets = [*base, f"model.source={root / 'weights'}", "model.init=auto", "train.steps=2", "checkpoint.every=1"]
    flags = ["--gpus", "2xcpu", *(x for s in [*sets, f"train.output_dir={shared}"] for x in ("--set", s))]
    code, script = launch(tmp_path, "slurm", *flags, "--nodes", "1", "--port", str(_free_ports(1)[0]))
    assert code == 0 and "#SBATCH --nodes=1" in script.read_text()
    env = {
        **slurm_cluster,
        "HOME": str(home),  # the job's registry: ~/.cache/trainplan/runs.sqlite
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # this environment's torchrun
    }
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    # polled here each second, not with `sbatch --wait`, whose interval grows to 10 s
    deadline, shown = time.monotonic() + 600, None
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True)
        state = re.search(r"JobState=(\w+)", shown.stdout)
        if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        time.sleep(1)
    output = "".join(p.read_text() for p in tmp_path.glob("trainplan-job-*.out"))
    assert "JobState=COMPLETED" in shown.stdout and "ExitCode=0:0" in shown.stdout, shown.stdout + output[-4000:]
    record = json.loads((shared / "record.json").read_text())
    assert record["hardware"]["world_size"] == 2 and [s["step"] for s in record["steps"]] == [1, 2]
    rows = registry.rows(home / ".cache" / "trainplan" / "runs.sqlite")
    assert [(r["kind"], r["output_dir"], r["devices"]) for r in rows] == [("train", str(shared), "2xcpu")]
