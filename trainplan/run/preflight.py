"""Per-node preflight: before any rank builds its model, check that each node has what the plan needs.

- Device memory (CUDA): the GPU's free memory (`torch.cuda.mem_get_info`, measured after this
  process's CUDA context exists) covers the rank's planned need (`Bill.device_bytes`), or the run
  stops. Free memory that covers the need but not the verdict's margin on top of it
  (`Bill.device_margin_bytes`: the plan's accuracy band and the caching allocator's reserve) is the
  plan's TIGHT: the run goes on, and the check's line says it may run out of memory.
- Host RAM: `MemAvailable` of /proc/meminfo covers the sum of the host needs (`Bill.host_bytes`) of
  every rank on that node (ranks are grouped by hostname, so two "nodes" on one machine share it).
  On the CPU a rank's whole bill is host memory, so that is the only memory check there.
- The checkpoint directory: rank 0 writes a probe file holding a random token into it; every rank
  reads it back after a collective. A missing or different token means the ranks do not see one
  directory, and DCP writes every rank's shards into one directory, so it needs a shared filesystem.

The engine imports no planner: the caller hands in the `Bill` (trainplan/plan/bill.py makes it
from the analytic plan of the resolved config). Without one, only the directory is checked.

Every rank gathers every rank's findings before any proceeds, so a failure anywhere ends every rank
(non-zero exit, one line per finding naming the node, rank and shortfall). A rank that never arrives
ends the others after the process group's timeout (parallel.timeout_s).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainplan import config as C
from trainplan.errors import TrainplanError
from trainplan.run import dist
from trainplan.spec.devices import format_gib, meminfo_bytes

PROBE = ".trainplan-preflight"


class PreflightError(TrainplanError):
    """A node lacks what the run needs; one line per finding."""


@dataclass(frozen=True, kw_only=True)
class Bill:
    """What each rank needs, from the plan. Index: the global rank."""

    device_bytes: tuple[int, ...]  # device memory that must be free when the check runs
    device_margin_bytes: tuple[int, ...] = ()  # the verdict's margin on top of it: short of it, TIGHT
    host_bytes: tuple[int, ...]  # host RAM the rank needs; a node's ranks' figures add up
    source: str = "the plan"  # named in a failure: where the figures come from


BillFn = Callable[[C.RunConfig], Bill]  # the resolved config -> its bill (the caller plans it)


# ---- readers (tests replace these) ------------------------------------------------------------


def free_device_bytes(device: torch.device) -> int:
    """Free memory on the GPU, as the driver reports it (other processes' use taken out)."""
    return torch.cuda.mem_get_info(device)[0]


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo: what can be allocated without swapping; None off Linux."""
    return meminfo_bytes("MemAvailable")


def hostname() -> str:
    return socket.gethostname()


# ---- the checks, each one node's or one rank's, pure ------------------------------------------


def device_problem(host: str, rank: int, device: torch.device, free: int, need: int, source: str) -> str | None:
    if free >= need:
        return None
    return (
        f"preflight: node {host} rank {rank}: {device} has {format_gib(free)} free, {source} needs {format_gib(need)} "
        f"for this rank: short by {format_gib(need - free)}; free the GPU (another process holds memory: "
        "nvidia-smi lists it) or plan a smaller layout"
    )


def device_warning(rank: int, device: torch.device, free: int, need: int, margin: int) -> str | None:
    """TIGHT: the free memory covers the need, not the margin on top of it."""
    if margin <= 0 or free >= need + margin:
        return None
    return (
        f"TIGHT on rank {rank}: {device} has {format_gib(free)} free for a need of {format_gib(need)} and a "
        f"{format_gib(margin)} margin, so it may run out of memory"
    )


def host_problem(host: str, ranks: list[int], available: int | None, need: int, source: str) -> str | None:
    if available is None or available >= need:
        return None
    return (
        f"preflight: node {host} rank {ranks[0]}: host RAM has {format_gib(available)} available, {source} needs "
        f"{format_gib(need)} for the node's {_ranks_text(ranks)} to load and save checkpoints: short by "
        f"{format_gib(need - available)}; free host memory or put fewer ranks on a node"
    )


def probe_problem(host: str, rank: int, directory: Path, token: str, found: str | None, writer: str) -> str | None:
    if found == token:
        return None
    what = "is missing" if found is None else "holds another run's token"
    return (
        f"preflight: node {host} rank {rank}: checkpoint directory {str(directory)!r} is not the one rank 0 "
        f"(node {writer}) writes: its probe file {what}; checkpoints need one directory every node shares: "
        "put checkpoint.dir (or train.output_dir) on a shared filesystem mounted at the same path on every node"
    )


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"{len(ranks)} ranks ({', '.join(map(str, ranks))})"


# ---- the probe file ---------------------------------------------------------------------------


def write_probe(directory: Path) -> tuple[str, list[Path]]:
    """Rank 0: a random token into directory/PROBE; (token, directories created for it)."""
    created, d = [], directory.absolute()
    while not d.exists() and d != d.parent:
        created.append(d)
        d = d.parent
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    path = directory / PROBE
    with open(path, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())  # visible to the other nodes before the collective that tells them to read
    return token, created


def read_probe(directory: Path) -> str | None:
    try:
        return (directory / PROBE).read_text()
    except OSError:
        return None


def remove_probe(directory: Path, created: list[Path]) -> None:
    (directory / PROBE).unlink(missing_ok=True)
    for d in created:  # innermost first: only what write_probe made, and only if still empty
        try:
            d.rmdir()
        except OSError:
            break


# ---- all ranks together -----------------------------------------------------------------------


def check(env: dist.DistEnv, checkpoint_dir: Path | None, bill: Bill | None) -> str:
    """Run every check on every rank; raise PreflightError on every rank if any fails anywhere.

    checkpoint_dir: where the run writes checkpoints (None: it writes none, nothing to probe).
    Returns what was checked, for the progress line."""
    assert bill is None or len(bill.device_bytes) == len(bill.host_bytes) == env.world, "a bill for another world"
    host = hostname()
    problems, warning = [], None
    if bill is not None and env.device.type == "cuda":
        free, need = free_device_bytes(env.device), bill.device_bytes[env.rank]
        problems.append(device_problem(host, env.rank, env.device, free, need, bill.source))
        margin = bill.device_margin_bytes[env.rank] if bill.device_margin_bytes else 0
        warning = device_warning(env.rank, env.device, free, need, margin)
    probing = checkpoint_dir is not None and env.world > 1
    token, created = None, []
    if probing and env.is_main:
        try:
            token, created = write_probe(checkpoint_dir)
        except OSError as e:
            problems.append(
                f"preflight: node {host} rank 0: cannot write a probe into checkpoint directory "
                f"{str(checkpoint_dir)!r} ({e.strerror}); choose a directory every node can write"
            )
    # the first collective: rank 0's probe is written before any rank reads it
    seen = env.gather({"host": host, "token": token, "warning": warning})
    if probing and seen[0]["token"] is not None and not env.is_main:
        found = read_probe(checkpoint_dir)
        problems.append(probe_problem(host, env.rank, checkpoint_dir, seen[0]["token"], found, seen[0]["host"]))
    local = [r for r, s in enumerate(seen) if s["host"] == host]
    if bill is not None and env.rank == local[0]:  # the node's first rank speaks for its RAM
        need = sum(bill.host_bytes[r] for r in local)
        problems.append(host_problem(host, local, available_host_bytes(), need, bill.source))
    try:
        everyone = env.gather([p for p in problems if p])  # no rank proceeds before all have reported
    finally:
        if created or token:
            remove_probe(checkpoint_dir, created)
    failed = [r for r, lines in enumerate(everyone) if lines]
    if failed:  # rank 0 prints every finding, each other rank its own (or where to look)
        mine = [p for lines in everyone for p in lines] if env.is_main else everyone[env.rank]
        raise PreflightError("\n".join(mine) or f"preflight failed on rank {failed[0]}; rank 0's log lists why")
    nodes = len({s["host"] for s in seen})
    checked = ["device memory"] if bill is not None and env.device.type == "cuda" else []
    checked += ["host RAM"] if bill is not None else []
    checked += ["one checkpoint directory"] if probing else []
    if not checked:
        return "nothing to check: no plan given, and no checkpoint directory that ranks share"
    warnings = [s["warning"] for s in seen if s["warning"]]
    tight = "; " + "; ".join(warnings[:2]) + (f" (and {len(warnings) - 2} more ranks)" if len(warnings) > 2 else "")
    done = f"{', '.join(checked)} on {nodes} node(s), {env.world} rank(s)" + ("" if bill else " (no plan given)")
    return done + (tight if warnings else "")
