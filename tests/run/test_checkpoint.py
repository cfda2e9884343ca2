"""Checkpoints: bitwise continuation, damaged and malicious checkpoints, mismatched configs."""

import json
import os
import pickle

import pytest

from trainplan import config as C
from trainplan.commands.train import execute
from trainplan.errors import ConfigError
from trainplan.files import sha256_file
from trainplan.run import checkpoint
from trainplan.verify.resume import verify

torch = pytest.importorskip("torch")


def cli_args(tiny_run, *extra):
    root, base = tiny_run
    out = []
    for item in [*base, *extra]:
        out += ["--set", item]
    return out


# a full fine-tune resumes bitwise in one process in tests/run/test_fault_injection.py::
# test_kill_anywhere_then_resume_auto_is_bitwise[single] (20 resumes after SIGKILLs, the final weights,
# optimizer state and next batch bitwise); verify-resume's per-step comparison in the two cases here
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "extra", "steps", "at"),
    [
        (
            "lora with dropout, cosine LR, accumulation 2",
            ["mode=lora", "lora.dropout=0.1", "train.schedule=cosine", "batch.grad_accum_steps=2"],
            5,
            2,
        ),
        # 4 training documents pack into 96 sequences of 32 tokens: 16 per step ends epoch 0 at step 6
        ("lora at an epoch boundary", ["mode=lora", "batch.micro_batch_size=16"], 9, 6),
    ],
)
@pytest.mark.multiprocess
def test_resume_is_bitwise_identical_to_the_uninterrupted_run(tiny_run, tmp_path, name, extra, steps, at):
    result = verify(cli_args(tiny_run, *extra), steps=steps, at=at, workdir=tmp_path)
    assert result["passed"], (name, result["checks"], result["max_deviation"])
    assert result["max_deviation"] == {"loss": 0.0, "grad_norm": 0.0, "lr": 0.0}
    if "epoch" in name:  # the checkpoint falls exactly where epoch 0 ends
        assert result["train_sequences"] == at * 16


def run(tiny_run, out, *extra):
    root, base = tiny_run
    record = execute(C.load(None, [*base, f"train.output_dir={out}", *extra]), quiet=True)[0].to_json()
    return record


@pytest.mark.slow
def test_double_resume(tiny_run, tmp_path):
    common = ["mode=lora", "train.steps=6", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=2"]
    full = run(tiny_run, tmp_path / "a", "mode=lora", "train.steps=6")
    run(tiny_run, tmp_path / "b", *common, "train.stop_after=2")
    run(tiny_run, tmp_path / "b", *common, "train.stop_after=4", "checkpoint.resume=auto")
    last = run(tiny_run, tmp_path / "b", *common, "checkpoint.resume=auto")
    assert last["resume"]["step"] == 4
    assert [s["loss"] for s in last["steps"]] == [s["loss"] for s in full["steps"][4:]]
    assert last["final"] == full["final"]


@pytest.fixture
def three_checkpoints(tiny_run, tmp_path):
    ck = tmp_path / "ck"
    run(tiny_run, tmp_path / "a", "mode=lora", f"checkpoint.dir={ck}", "checkpoint.every=1", "checkpoint.keep_last=3")
    return ck


def test_keeps_the_last_n_and_validates_them(three_checkpoints):
    names = sorted(p.name for p in three_checkpoints.iterdir())
    assert names == ["step-00000001", "step-00000002", "step-00000003"]
    assert all(checkpoint.validate(three_checkpoints / n) is None for n in names)
    manifest = json.loads((three_checkpoints / names[-1] / "manifest.json").read_text())
    assert set(manifest["parts"]) >= {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng-rank0.pt", "state.json"}
    assert "optimizer state" in manifest["holds"] and manifest["lacks"]


def test_damaged_checkpoints_are_skipped_with_the_reason(tiny_run, tmp_path, three_checkpoints):
    ck = three_checkpoints
    weights = ck / "step-00000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated
    opt = ck / "step-00000002" / "optimizer.pt"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    opt.write_bytes(bytes(data))
    path, skipped = checkpoint.latest_valid(ck)
    assert path.name == "step-00000001"
    assert skipped == [
        ("step-00000003", "part model.safetensors is truncated (" + skipped[0][1].split("(")[1]),
        ("step-00000002", "part optimizer.pt fails its checksum"),
    ]
    (ck / "step-00000001" / "rng-rank0.pt").unlink()
    assert checkpoint.validate(ck / "step-00000001") == "part rng-rank0.pt is missing"
    record = run(
        tiny_run, tmp_path / "b", "mode=lora", "train.steps=4", f"checkpoint.dir={ck}", "checkpoint.resume=auto"
    )
    assert record["resume"]["from"] is None and len(record["resume"]["skipped"]) == 3  # started afresh, said why


def test_a_later_look_reads_no_checked_part_again_but_a_rewritten_one_is_read(three_checkpoints, monkeypatch):
    """keep_last's pruning and the space estimate look at every kept checkpoint at each save: a part
    whose file is unchanged since this process summed it is not read again (a save read 5 checkpoints'
    parts, 1 of them new: a tiny run's 80 steps with checkpoint.every = 1 took 23.0 s, now 13.3 s); one
    rewritten in place, same size, is read and refused."""
    from trainplan import files

    reads = []
    real = files.hashlib.sha256

    def counted(*args):
        reads.append(1)
        return real(*args)

    monkeypatch.setattr(files.hashlib, "sha256", counted)
    step = three_checkpoints / "step-00000003"
    assert checkpoint.validate(step) is None and not reads  # written by this process: its sums are known
    opt = step / "optimizer.pt"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    opt.write_bytes(bytes(data))
    assert checkpoint.validate(step) == "part optimizer.pt fails its checksum" and len(reads) == 1
    assert sha256_file(opt) != sha256_file(step.with_name("step-00000002") / "optimizer.pt") and len(reads) == 3


def _rewrite(step_dir, name, data: bytes):
    """Replace one part of a checkpoint and redo its manifest entry: the sums agree, the content lies."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["parts"][name] = {"bytes": len(data), "sha256": sha256_file(step_dir / name)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_whose_sums_agree_but_whose_files_are_malformed_is_skipped(tiny_run, tmp_path):
    """A safetensors header that promises bytes the file lacks, or a state.json that is not an object,
    written with matching checksums: resume=auto once crashed in the loader on them. Now each is skipped
    with its reason, and the run resumes from the newest sound checkpoint, bitwise as if uninterrupted."""
    ck = tmp_path / "ck"
    common = ["mode=lora", "train.steps=4", f"checkpoint.dir={ck}", "checkpoint.every=1", "checkpoint.keep_last=3"]
    full = run(tiny_run, tmp_path / "full", "mode=lora", "train.steps=4")
    run(tiny_run, tmp_path / "a", *common, "train.stop_after=3")
    weights = ck / "step-00000003" / "model.safetensors"
    raw = weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [d * 2 for d in header[name]["shape"]]  # twice the bytes its offsets hold
    head = json.dumps(header).encode()
    _rewrite(ck / "step-00000003", "model.safetensors", len(head).to_bytes(8, "little") + head + raw[8 + n :])
    _rewrite(ck / "step-00000002", "state.json", b"[1, 2, 3]")
    path, skipped = checkpoint.latest_valid(ck)
    assert path.name == "step-00000001"
    assert skipped[0][0] == "step-00000003" and "model.safetensors: tensor" in skipped[0][1]
    assert "bytes for its shape" in skipped[0][1]
    assert skipped[1] == ("step-00000002", "state.json is not a JSON object")
    resumed = run(tiny_run, tmp_path / "b", *common, "checkpoint.resume=auto")
    assert resumed["resume"]["step"] == 1
    assert [s["checkpoint"] for s in resumed["resume"]["skipped"]] == ["step-00000003", "step-00000002"]
    assert [(s["step"], s["loss"]) for s in resumed["steps"]] == [(s["step"], s["loss"]) for s in full["steps"][1:]]
    assert resumed["final"] == full["final"]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/trainplan-pwned",))


def test_a_pickled_payload_is_refused_without_running(tiny_run, tmp_path, three_checkpoints):
    target = three_checkpoints / "step-00000003"
    with open(target / "optimizer.pt", "wb") as f:
        pickle.dump({"state": _Exploit()}, f)
    manifest = json.loads((target / "manifest.json").read_text())  # forge a matching manifest
    manifest["parts"]["optimizer.pt"] = {
        "bytes": (target / "optimizer.pt").stat().st_size,
        "sha256": sha256_file(target / "optimizer.pt"),
    }
    (target / "manifest.json").write_text(json.dumps(manifest))
    if os.path.exists("/tmp/trainplan-pwned"):
        os.remove("/tmp/trainplan-pwned")
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.pt holds a pickled payload that would run code"):
        run(tiny_run, tmp_path / "b", "mode=lora", f"checkpoint.dir={three_checkpoints}", "checkpoint.resume=auto")
    assert not os.path.exists("/tmp/trainplan-pwned")


@pytest.mark.parametrize(
    ("change", "what"), [("mode=full", "mode"), ("lora.r=4", "config"), ("optim.lr=0.5", "config")]
)
def test_a_checkpoint_from_another_run_is_refused(tiny_run, tmp_path, three_checkpoints, change, what):
    extra = [change] if change.startswith("mode") else ["mode=lora", change]
    with pytest.raises(ConfigError, match=f"was written for another {what}"):
        run(tiny_run, tmp_path / "b", *extra, f"checkpoint.dir={three_checkpoints}", "checkpoint.resume=auto")


def test_pruning_keeps_only_this_runs_newest_and_never_touches_another_runs(tmp_path):
    """Pruning once counted every valid step-* in the directory: a 3-step run deleted its own
    checkpoints because an earlier run's were newer."""
    from trainplan.run.checkpoint import format as fmt

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)

    def save(step, run_id):
        state = {"mode": "full", "step": step, "tokens_seen": 0, "run_id": run_id}
        return fmt.save(
            tmp_path, step=step, model=model, optimizer=opt, scheduler=sched, scaler=None, state=state, keep_last=1
        )

    for step in (4, 5, 6):  # the older, longer run
        save(step, "older")
    for step in (1, 2, 3):  # this run, keep_last = 1
        save(step, "this")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step-00000003", "step-00000006"]  # each run's newest; the other run untouched
    assert fmt.run_id_of(tmp_path / "step-00000003") == "this"
    assert json.loads((tmp_path / "step-00000006" / "manifest.json").read_text())["run_id"] == "older"


def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(tiny_run, tmp_path):
    from trainplan.run.checkpoint import format as fmt

    ck = tmp_path / "ck"
    common = ["mode=lora", f"checkpoint.dir={ck}", "checkpoint.every=2", "train.measure_memory=false"]
    first = run(tiny_run, tmp_path / "a", *common, "train.steps=4")
    with pytest.raises(ConfigError, match=r"^checkpoint.dir: .* holds another run's checkpoints \(step-00000004, run "):
        run(tiny_run, tmp_path / "b", *common, "train.steps=6")
    assert not (tmp_path / "b" / "record.json").exists()
    resumed = run(tiny_run, tmp_path / "c", *common, "train.steps=6", "checkpoint.resume=auto")
    assert resumed["resume"]["step"] == 4  # continued explicitly, as that run's lineage
    lineage = {fmt.run_id_of(p) for p in ck.iterdir() if p.name.startswith("step-")}
    assert len(lineage) == 1  # one lineage: the resumed run carried the first run's id on
    assert first["steps"][-1]["step"] == 4 and [s["step"] for s in resumed["steps"]] == [5, 6]


def _tiny_saver(root):
    """fmt.save of a tiny Linear into `root`, one lineage ("this")."""
    from trainplan.run.checkpoint import format as fmt

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)

    def save(step, keep_last=2):
        state = {"mode": "full", "step": step, "tokens_seen": 0, "run_id": "this"}
        return fmt.save(
            root, step=step, model=model, optimizer=opt, scheduler=sched, scaler=None, state=state, keep_last=keep_last
        )

    return save


def test_a_malformed_or_escaping_manifest_is_a_skipped_checkpoint_never_a_crash(tmp_path):
    """Valid JSON of the wrong shape crashed resume and every later save; a part could name a path
    outside the checkpoint."""
    from trainplan.run.checkpoint import format as fmt

    save = _tiny_saver(tmp_path)
    save(1)
    good = tmp_path / "step-00000001"
    for name, manifest, reason in [
        ("step-00000007", [1, 2, 3], "incomplete or of another format"),
        ("step-00000008", {"schema": fmt.SCHEMA, "complete": True, "parts": [1]}, "wrong structure"),
        (
            "step-00000009",
            {"schema": fmt.SCHEMA, "complete": True, "parts": {"../../etc/hostname": {"bytes": 1, "sha256": "x"}}},
            "points outside",
        ),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps(manifest))
        assert reason in fmt.validate(tmp_path / name)
    path, skipped = fmt.latest_valid(tmp_path)
    assert path == good and [n for n, _ in skipped] == ["step-00000009", "step-00000008", "step-00000007"]
    save(2)  # saving (and pruning) beside them still works, and leaves them alone
    assert fmt.validate(tmp_path / "step-00000002") is None and (tmp_path / "step-00000009").is_dir()


def test_a_kill_during_pruning_leaves_nothing_half_deleted(tmp_path):
    """Pruning renames a checkpoint out of the step-* namespace before removing it: what a kill
    leaves is a .del-* directory, removed at the next start, never a damaged step-*."""
    from trainplan.run.checkpoint import format as fmt

    save = _tiny_saver(tmp_path)
    for step in (1, 2):
        save(step)
    # a kill mid-removal: the rename happened, the tree is half gone
    doomed = tmp_path / f"{fmt.DELETING}step-00000001-99999999"
    os.replace(tmp_path / "step-00000001", doomed)
    (doomed / "optimizer.pt").unlink()
    assert [p.name for p in fmt._candidates(tmp_path)] == ["step-00000002"]  # never mistaken for a checkpoint
    fmt.clean_leftovers(tmp_path)  # what CheckpointManager runs at every start
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    save(3, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]


def test_a_full_disk_is_one_line_keeps_the_last_checkpoint_and_leaves_no_temp(tmp_path, monkeypatch):
    """A stand-in for ENOSPC from the writer (and, before it, a space check that refuses outright)."""
    import errno

    from trainplan.run.checkpoint import format as fmt

    save = _tiny_saver(tmp_path)
    save(1)
    real_save = torch.save

    def full(obj, f, *a, **k):
        if "scheduler" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(fmt.torch, "save", full)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"^checkpoint.dir: writing step 2 to .* failed: no space left"
    ):
        save(2)
    monkeypatch.setattr(fmt.torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]  # the temp dir is gone
    assert fmt.validate(tmp_path / "step-00000001") is None

    Usage = type(__import__("shutil").disk_usage(tmp_path))
    monkeypatch.setattr(fmt.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 100, 100))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"has 0\.1 KiB free, checkpoint step 2 needs about .* KiB \(short by"
    ):
        save(2)
    monkeypatch.undo()
    save(2)  # once there is space, saving goes on
    assert fmt.validate(tmp_path / "step-00000002") is None


@pytest.mark.multiprocess
def test_two_live_runs_cannot_write_one_directory(tmp_path):
    """A lock file names the live writer; a lock whose process is gone is taken over."""
    import socket
    import subprocess
    import sys

    from trainplan.files import DirLock

    first = DirLock(tmp_path, "train.output_dir").acquire()
    with pytest.raises(ConfigError, match=r"^train.output_dir: .* is in use by another run \(pid \d+ on "):
        DirLock(tmp_path, "train.output_dir").acquire()
    first.release()
    assert not (tmp_path / DirLock.NAME).exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / DirLock.NAME).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    DirLock(tmp_path, "train.output_dir").acquire().release()  # stale: its process is gone


def test_progress_a_checkpoint_claims_must_agree_with_itself(tiny_run, tmp_path, three_checkpoints):
    """state.json edited to step 10**9 (its sum rewritten too) made a resume run 0 steps, exit 0."""
    from trainplan.run.checkpoint import format as fmt

    ck = three_checkpoints
    newest = ck / "step-00000003"
    state = json.loads((newest / "state.json").read_text())
    (newest / "state.json").write_text(json.dumps({**state, "step": 10**9}))
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["parts"]["state.json"] = {
        "bytes": (newest / "state.json").stat().st_size,
        "sha256": sha256_file(newest / "state.json"),
    }
    (newest / "manifest.json").write_text(json.dumps(manifest))
    assert fmt.validate(newest) is None  # the sums agree: only the progress itself gives it away
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"state.json says step 1000000000, the directory and manifest say 00000003 and 3",
    ):
        run(tiny_run, tmp_path / "b", "mode=lora", "train.steps=6", f"checkpoint.dir={ck}", "checkpoint.resume=auto")
    with pytest.raises(
        ConfigError, match=r"^train.steps: step-00000002 is at step 2, at or past train.steps = 2: nothing"
    ):
        resume = f"checkpoint.resume={ck / 'step-00000002'}"
        run(tiny_run, tmp_path / "c", "mode=lora", "train.steps=2", f"checkpoint.dir={ck}", resume)
