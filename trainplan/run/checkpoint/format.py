"""Checkpoints that resume the same run: written atomically, verified by checksum, loaded safely.

A checkpoint is a directory `step-NNNNNNNN/` holding:

| part            | what                                                         | format              |
|-----------------|--------------------------------------------------------------|---------------------|
| model.safetensors | full mode: every trainable weight; lora: the adapter only   | safetensors         |
| optimizer.pt    | optimizer state (tensors, numbers)                           | torch.load(weights_only=True) |
| scheduler.pt    | LR scheduler state                                           | weights_only        |
| scaler.pt       | GradScaler state (amp-fp16)                                  | weights_only        |
| rng.pt          | python, numpy, torch CPU and every CUDA generator           | weights_only        |
| state.json      | step, tokens seen, sampler position, guard state, config     | JSON                |
| manifest.json   | every part's size and sha256; what the checkpoint holds and lacks | JSON, written last |

It is written to a temporary directory, fsynced, then renamed; it counts only when its manifest
is complete and every checksum verifies, so a crash mid-write leaves nothing that looks valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trainplan.errors import ConfigError, TrainplanError
from trainplan.files import fsync_dir, fsync_file, pid_alive, read_json, safetensors_header, sha256_file
from trainplan.run.dist import full_tensor, to_local

SCHEMA = "trainplan.checkpoint/1"
PREFIX = "step-"
DELETING = ".del-"  # a checkpoint being removed (renamed first)


class CheckpointError(TrainplanError):
    """A checkpoint that cannot be used, with the reason."""


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must hold: the trainable ones (full: all; lora: adapters)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: full_tensor(t).detach().contiguous().cpu() for n, t in model.state_dict().items() if n in names}


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": list(random.getstate()[1]) + [random.getstate()[2] or 0],
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())],
    }


def set_rng_state(state: dict) -> None:
    mt = tuple(int(x) for x in state["python"][:-1])
    random.setstate((state["python_version"], mt, state["python_gauss"]))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(s, i)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _dcp_state(model: nn.Module, optimizer) -> dict:
    """Model (trainable tensors only) and optimizer state as DCP sees them: FQN-keyed, sharded
    DTensors under FSDP2, plain tensors otherwise, so any world size can read them back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from trainplan.features.tensor_parallel.engine import checkpointable

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return checkpointable({"model": msd, "optimizer": osd})


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns when there is no process group; one process reading or writing shards is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(
    root: Path,
    *,
    step: int,
    model: nn.Module,
    optimizer,
    scheduler,
    scaler,
    state: dict,
    keep_last: int,
    sharded: bool = False,
    kill: str | None = None,
) -> Path:
    """Write checkpoint `step` under root atomically; keep the newest `keep_last` valid ones.

    Every rank writes its own RNG state into the shared temporary directory. Replicated runs (one
    process, DDP, ZeRO-1): rank 0 writes weights (safetensors) and optimizer state. Sharded runs
    (FSDP2): every rank writes its own shards of both through torch.distributed.checkpoint (DCP).
    Rank 0 then writes the manifest and renames.

    kill: fault injection (tests), one of config.KILL_KINDS: rank 0 SIGKILLs itself at that point.
    """
    import torch.distributed as dist

    rank, world = _rank_world()
    final = root / f"{PREFIX}{step:08d}"
    problem = None  # rank 0 checks the space; every rank learns the answer
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        try:
            require_space(root, expected_bytes(root, model, optimizer, world if sharded else 1), step)
        except CheckpointError as e:
            problem = str(e)
    shared = [os.getpid(), problem]
    if world > 1:
        dist.broadcast_object_list(shared, src=0)
    if shared[1]:
        raise CheckpointError(shared[1])
    tmp = root / f".tmp-{PREFIX}{step:08d}-{shared[0]}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        _write(
            tmp, root, final, step, model, optimizer, scheduler, scaler, state, keep_last, sharded, rank, world, kill
        )
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the space it held; the last good checkpoint stays
        if isinstance(e, RuntimeError) and not _is_write_failure(e):
            raise
        raise CheckpointError(_write_failure_text(root, step, e)) from None
    return final


def _write(tmp, root, final, step, model, optimizer, scheduler, scaler, state, keep_last, sharded, rank, world, kill):
    from safetensors.torch import save_file

    if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: gather the shards on rank 0
        optimizer.consolidate_state_dict(to=0)
    _barrier()
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
    if sharded:
        import torch.distributed.checkpoint as dcp

        with _single_process_ok():
            dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(tmp / "dcp"))
    _barrier()
    if rank == 0:
        parts = {"scheduler.pt": scheduler.state_dict()}
        if not sharded:
            save_file(trainable_state(model), str(tmp / "model.safetensors"))
            parts["optimizer.pt"] = optimizer.state_dict()
        _die_if(kill == "kill-writing")  # weights (or every rank's shards) written, the rest not
        if scaler is not None:
            parts["scaler.pt"] = scaler.state_dict()
        for name, obj in parts.items():
            torch.save(obj, tmp / name)
        fmt = "dcp" if sharded else "safetensors"
        (tmp / "state.json").write_text(
            json.dumps({**state, "world_size": world, "format": fmt}, indent=1, sort_keys=True)
        )
        _finish(root, tmp, final, step, world, scaler is not None, state, keep_last, fmt, kill)
    _barrier()


def _die_if(condition: bool) -> None:
    """Fault injection (tests): die here as a kill -9 or a lost node would, with no clean-up."""
    if condition:
        os.kill(os.getpid(), signal.SIGKILL)


def expected_bytes(root: Path, model: nn.Module, optimizer, world: int) -> int:
    """What the next checkpoint will take: the newest one's size where there is one, else the
    trainable weights and optimizer state (`world`: this rank's shards x the sharding degree)."""
    newest = next((p for p in _candidates(root) if validate(p) is None), None)
    if newest is not None:
        return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    inner = getattr(optimizer, "optim", optimizer)
    states = [v for st in inner.state.values() if isinstance(st, dict) for v in st.values()]
    tensors = [p for p in model.parameters() if p.requires_grad] + [v for v in states if isinstance(v, torch.Tensor)]
    return world * sum(to_local(t).numel() * t.element_size() for t in tensors)  # local shards, no collective


def require_space(root: Path, needed: int, step: int) -> None:
    """Refuse a save the filesystem cannot hold, before writing a byte of it."""
    free = shutil.disk_usage(root).free
    if free < needed:
        raise CheckpointError(
            f"checkpoint.dir: {str(root)!r} has {_mib(free)} free, checkpoint step {step} needs about "
            f"{_mib(needed)} (short by {_mib(needed - free)}); free space, lower checkpoint.keep_last, or "
            "point checkpoint.dir at a larger disk. The last good checkpoint is kept"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _is_write_failure(e: RuntimeError) -> bool:
    """torch.save reports a full disk as a RuntimeError from its zip writer."""
    text = str(e)
    return "inline_container" in text or "file write failed" in text or "No space left" in text


def _write_failure_text(root: Path, step: int, e: BaseException) -> str:
    import errno

    code = getattr(e, "errno", None)
    if code == errno.ENOSPC or "No space left" in str(e) or isinstance(e, RuntimeError):
        free = shutil.disk_usage(root).free if root.exists() else 0
        what = f"no space left ({_mib(free)} free)"
        fix = "free space, lower checkpoint.keep_last, or point checkpoint.dir at a larger disk"
    elif code == errno.EROFS:
        what, fix = "the filesystem is read-only", "point checkpoint.dir at a writable disk"
    else:
        what, fix = getattr(e, "strerror", None) or str(e).splitlines()[0], "check checkpoint.dir"
    return (
        f"checkpoint.dir: writing step {step} to {str(root)!r} failed: {what}; {fix}. "
        "The partial write was removed and the last good checkpoint is kept"
    )


def _finish(
    root: Path,
    tmp: Path,
    final: Path,
    step: int,
    world: int,
    has_scaler: bool,
    state: dict,
    keep_last: int,
    fmt: str,
    kill: str | None = None,
) -> None:
    mode = state.get("mode")
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    for name in files:
        fsync_file(tmp / name)
    for sub in {(tmp / name).parent for name in files}:
        fsync_dir(sub)
    manifest = {
        "schema": SCHEMA,
        "step": step,
        "complete": True,
        "world_size": world,
        "run_id": state.get("run_id"),  # the run (lineage) this checkpoint belongs to
        "format": fmt,  # safetensors: replicated weights; dcp: per-rank shards, readable at any world size
        "parts": {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)} for name in files},
        "holds": [
            "trainable weights" + (" (DCP shards)" if fmt == "dcp" else ""),
            "optimizer state" + (" (DCP shards)" if fmt == "dcp" else ""),
            "LR scheduler",
            "RNG per rank (python, numpy, torch, cuda)",
            "training progress",
            "data position",
            "stability-guard state",
            "resolved config",
        ]
        + (["GradScaler"] if has_scaler else []),
        "lacks": ["frozen base weights (LoRA: identified by the base fingerprint)"] if mode != "full" else [],
    }
    with open(tmp / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    _die_if(kill == "kill-publishing")  # complete, checksummed, not yet renamed into place
    if final.exists():
        remove(final)
    os.replace(tmp, final)
    fsync_dir(root)
    _prune(root, keep_last, state.get("run_id"), kill == "kill-pruning")


def validate(path: Path, *, sums: bool = True) -> str | None:
    """None if the checkpoint is complete and every checksum verifies, else the reason. sums=False:
    everything but the checksums (a run's early look at the checkpoint it was told to resume from,
    before the full check where it loads)."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return "no manifest (incomplete write)"
    try:
        manifest = read_json(manifest_path, "manifest.json")
    except ConfigError:
        return "manifest is not valid JSON"
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or not manifest.get("complete"):
        return "manifest is incomplete or of another format"
    parts = manifest.get("parts")
    if not isinstance(parts, dict) or not all(
        isinstance(m, dict) and isinstance(m.get("bytes"), int) and isinstance(m.get("sha256"), str)
        for m in parts.values()
    ):
        return "manifest has the wrong structure (parts: {name: {bytes, sha256}})"
    inside = path.resolve()
    for name in parts:
        if Path(name).is_absolute() or not (path / name).resolve().is_relative_to(inside):
            return f"manifest part {name!r} points outside the checkpoint"
    for name, meta in parts.items():
        part = path / name
        if not part.is_file():
            return f"part {name} is missing"
        if part.stat().st_size != meta["bytes"]:
            return f"part {name} is truncated ({part.stat().st_size} of {meta['bytes']} bytes)"
        if sums and sha256_file(part, again=False) != meta["sha256"]:
            return f"part {name} fails its checksum"
    return _content_problem(path, manifest)


def _content_problem(path: Path, manifest: dict) -> str | None:
    """What a checkpoint whose checksums verify can still get wrong (a hand edit, a file written by
    something else with its manifest redone): state.json's and the safetensors header's shapes. (The
    progress state.json claims is checked where it is loaded: a consistent lie is refused, not skipped.)"""
    try:
        state = read_json(path / "state.json", "state.json")
    except ConfigError as e:
        return str(e).split("; ")[0]
    if not isinstance(state, dict):
        return "state.json is not a JSON object"
    if not isinstance(state.get("mode"), str) or not isinstance(state.get("config", {}), dict):
        return "state.json's mode is not a name or its config not a table"
    if "model.safetensors" in manifest["parts"]:
        return safetensors_problem(path / "model.safetensors")
    return None


def safetensors_problem(file: Path) -> str | None:
    """None if the safetensors file's header is well formed (files.safetensors_header)."""
    try:
        safetensors_header(file)
    except (OSError, ValueError) as e:
        return f"{file.name}: {e}"
    return None


def _candidates(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)), reverse=True)


def latest_valid(root: Path) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest valid checkpoint, and the newer ones skipped with their reasons."""
    skipped = []
    for path in _candidates(root):
        reason = validate(path)
        if reason is None:
            return path, skipped
        skipped.append((path.name, reason))
    return None, skipped


def run_id_of(path: Path) -> str | None:
    """The run a checkpoint belongs to (state.json's run_id); None for an unreadable or older one."""
    try:
        state = read_json(path / "state.json", "state.json")
    except ConfigError:
        return None
    return state.get("run_id") if isinstance(state, dict) else None


def foreign(root: Path, run_id: str | None) -> list[Path]:
    """Valid checkpoints under root that belong to another run, newest first."""
    return [p for p in _candidates(root) if validate(p) is None and run_id_of(p) != run_id]


def _prune(root: Path, keep_last: int, run_id: str | None, kill: bool = False) -> None:
    """Keep this run's newest `keep_last` checkpoints; another run's are never touched."""
    own = [p for p in _candidates(root) if validate(p) is None and run_id_of(p) == run_id]
    for old in own[keep_last:]:
        remove(old, kill=kill)
    clean_leftovers(root)


def remove(path: Path, *, kill: bool = False) -> None:
    """Delete a checkpoint by renaming it out of the step-* namespace first: a kill during the
    removal leaves a `.del-*` directory that `clean_leftovers` finishes, never a half-deleted
    step-* that looks like a checkpoint. kill: fault injection, die with half of it deleted."""
    doomed = path.with_name(f"{DELETING}{path.name}-{os.getpid()}")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    if kill:
        files = sorted(p for p in doomed.rglob("*") if p.is_file())
        for f in files[: len(files) // 2 + 1]:
            f.unlink()
        _die_if(True)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_leftovers(root: Path) -> None:
    """Remove what dead writers left: interrupted removals, and temporary dirs of writers no
    longer alive (never a live writer's)."""
    if not root.is_dir():
        return
    for doomed in root.glob(f"{DELETING}*"):
        shutil.rmtree(doomed, ignore_errors=True)
    for stale in root.glob(f".tmp-{PREFIX}*"):  # writes that died: never valid, safe to remove
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _safe_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"checkpoint: {path.name} holds a pickled payload that would run code "
            f"({str(e).splitlines()[0][:120]}); refused"
        ) from None


def _load_replicated(path: Path, model: nn.Module, optimizer) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"), device="cpu")
    own = trainable_state(model)
    if set(tensors) != set(own):
        raise ConfigError(
            "checkpoint.resume",
            f"{path.name} holds other tensors than this model trains",
            "resume with the config that wrote it",
        )
    live = dict(model.state_dict())
    with torch.no_grad():
        for name, t in tensors.items():
            live[name].copy_(t)
    optimizer.load_state_dict(_safe_load(path / "optimizer.pt"))


def _load_dcp(path: Path, model: nn.Module, optimizer) -> None:
    """Read DCP shards into this run's own layout: each rank reads only the pieces it holds, in
    place, so the optimizer state never exists twice; a different world size reshards.

    DCP writes a state's non-tensor values from one rank, so every rank reads the same param groups
    back. Their hyperparameters are every rank's (one optimizer config, one schedule); their parameter
    names are the writing rank's, which under pipeline parallelism are one stage's (a stage loading
    them lost its own group's hyperparameters): every rank keeps the names of its own parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    sd = _dcp_state(model, optimizer)
    own_names = [list(group["params"]) for group in sd["optimizer"].get("param_groups", [])]
    try:
        with _single_process_ok():
            dcp.load(sd, checkpoint_id=str(path / "dcp"))
    except Exception as e:  # DCP raises CheckpointException with per-rank tracebacks
        first = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(
            "checkpoint.resume",
            f"{path.name} does not fit this model ({first})",
            "resume with the config that wrote it",
        ) from None
    for group, names in zip(sd["optimizer"].get("param_groups", []), own_names, strict=True):
        group["params"] = names
    set_state_dict(
        model,
        optimizer,
        model_state_dict=sd["model"],
        optim_state_dict=sd["optimizer"],
        # not strict: the frozen base is not in the checkpoint. Every trainable tensor is: dcp.load
        # above fails on any key of this run's state that the checkpoint lacks.
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )


def refuse_other_run(path: Path, state: dict, expect: dict) -> None:
    """A checkpoint written for another model, mode or incompatible config is refused by name."""
    for key, what in (("model_fingerprint", "model"), ("mode", "mode"), ("compat", "config")):
        if state.get(key) != expect.get(key):
            why = f"{path.name} was written for another {what} ({state.get(key)!r} vs this run's {expect.get(key)!r})"
            raise ConfigError("checkpoint.resume", why, "resume with the config that wrote it, or without --resume")


def load(path: Path, *, model: nn.Module, optimizer, scheduler, scaler, expect: dict, sharded: bool = False) -> dict:
    """Load a validated checkpoint into the run's objects; returns its state.json.

    Refuses a checkpoint from another model, mode or incompatible config. Tensors come from
    safetensors, everything else from torch.load(weights_only=True) mapped to the CPU first, so the
    optimizer state never passes through the accelerator at full size on top of the live one.
    """
    reason = validate(path)
    if reason is not None:
        raise CheckpointError(f"checkpoint: {path} is not usable: {reason}")
    state = json.loads((path / "state.json").read_text())
    problem = _progress_problem(path, state)
    if problem:
        raise CheckpointError(f"checkpoint: {path} is not usable: {problem}")
    refuse_other_run(path, state, expect)
    if state.get("format", "safetensors") == "dcp":
        _load_dcp(path, model, optimizer)
    elif sharded:
        raise ConfigError(
            "checkpoint.resume",
            f"{path.name} holds replicated weights (written by ddp/zero1); this run shards them with FSDP",
            "resume it with parallel.strategy = ddp or zero1",
        )
    else:
        _load_replicated(path, model, optimizer)
    scheduler.load_state_dict(_safe_load(path / "scheduler.pt"))
    if scaler is not None:
        scaler.load_state_dict(_safe_load(path / "scaler.pt"))
    rank, world = _rank_world()
    notes = []
    if state.get("world_size", 1) != world:
        moved = "resharded through DCP" if state.get("format") == "dcp" else "loaded on every rank"
        notes.append(
            f"written by {state.get('world_size', 1)} rank(s), resumed on {world}: weights and optimizer state "
            f"{moved}; the data continues from the same global position, but RNG streams (dropout) and "
            "the order of gradient reductions differ, so continuation is close, not bitwise exact"
        )
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(_safe_load(rng_file))
    state["notes"] = notes
    return state


def _progress_problem(path: Path, state) -> str | None:
    """The progress a checkpoint claims must agree with itself: state.json's step is the step in
    the directory's name and the manifest's, tokens and the data position are counts. (A state
    edited by hand once made a resume run 0 steps and exit 0.)"""
    if not isinstance(state, dict):
        return "state.json is not a JSON object"
    step, tokens = state.get("step"), state.get("tokens_seen")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, tokens)):
        return f"state.json's step and tokens_seen must be counts (got {step!r}, {tokens!r})"
    manifest = json.loads((path / "manifest.json").read_text())
    named = path.name[len(PREFIX) :]
    if not (named.isdigit() and int(named) == step == manifest.get("step")):
        return f"state.json says step {step}, the directory and manifest say {named} and {manifest.get('step')!r}"
    sampler = state.get("sampler")
    if not isinstance(sampler, dict) or not all(
        isinstance(sampler.get(k), int) and sampler.get(k) >= 0 for k in ("epoch", "position")
    ):
        return "state.json's data position (sampler epoch and position) is missing or not a count"
    return None


def tensor_hash(tensors) -> str:
    """sha256 over tensors' bytes, in a stable order (for comparing runs)."""
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(
            t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
            if t.dim()
            else t.detach().cpu().reshape(1).view(torch.uint8).numpy().tobytes()
        )
    return h.hexdigest()[:32]


def optimizer_hash(optimizer) -> str:
    state = optimizer.state_dict()["state"]
    items = []
    for pid in sorted(state):
        for key in sorted(state[pid]):
            value = state[pid][key]
            if isinstance(value, torch.Tensor):
                items.append((f"{pid}.{key}", full_tensor(value)))
    return tensor_hash(items)
