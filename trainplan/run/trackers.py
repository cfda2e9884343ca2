"""Metrics loggers (`train.report_to`): TensorBoard event files by default, MLflow and W&B when
installed, all offline and under train.output_dir, written by the main rank only.

Scalars, by the global optimizer step: train/loss, train/lr, train/grad_norm, train/tokens_per_s,
memory/<peak>_gib (the step's measured peak: max_allocated / max_reserved on CUDA, max_rss on
the CPU), and eval/loss, eval/perplexity, eval/token_accuracy at each held-out evaluation.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from trainplan import config as C
from trainplan.errors import ConfigError

# the package each logger needs, as `pip install` names it
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def require(report_to: list[str]) -> None:
    """Refuse a logger whose package is missing, before the run creates anything."""
    for name in report_to:
        package = PACKAGES.get(name)
        if package is None:
            continue
        try:
            missing = importlib.util.find_spec(package) is None
        except (ImportError, ValueError):  # a module entry of None in sys.modules
            missing = True
        if missing:
            raise ConfigError(
                "train.report_to",
                f"{name!r} needs the {package} package, which is not installed",
                f"pip install {package}, or remove {name!r} from train.report_to",
            )


def step_scalars(entry: dict) -> dict[str, float]:
    """What one optimizer step's record entry contributes."""
    out = {
        "train/loss": entry["loss"],
        "train/lr": entry["lr"],
        "train/grad_norm": entry["grad_norm"],
        "train/tokens_per_s": entry["tokens_per_s"],
    }
    for key, value in (entry.get("memory") or {}).items():
        out[f"memory/{key.removesuffix('_bytes')}_gib"] = value / 2**30
    if "eval" in entry:
        out |= eval_scalars(entry["eval"])
    return out


def eval_scalars(metrics: dict) -> dict[str, float]:
    return {f"eval/{k}": metrics[k] for k in ("loss", "perplexity", "token_accuracy")}


class _TensorBoard:
    def __init__(self, out: Path, cfg: C.RunConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("config", "```\n" + C.to_toml(cfg) + "\n```", 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self, status: str) -> None:
        self.writer.close()


class _MLflow:
    """A local file store under output_dir (mlruns/): nothing leaves the machine."""

    def __init__(self, out: Path, cfg: C.RunConfig) -> None:
        mlflow = importlib.import_module("mlflow")
        self.mlflow = mlflow
        mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
        mlflow.set_experiment("trainplan")
        self.run = mlflow.start_run(run_name=out.name)
        params = _flat(cfg.to_dict())
        for i in range(0, len(params), 100):  # log_params takes at most 100 at a time
            mlflow.log_params(dict(list(params.items())[i : i + 100]))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self, status: str) -> None:
        self.mlflow.end_run(status={"ok": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


class _WandB:
    """Offline mode (as WANDB_MODE=offline): the run stays under output_dir/wandb until `wandb sync`."""

    def __init__(self, out: Path, cfg: C.RunConfig) -> None:
        wandb = importlib.import_module("wandb")
        self.run = wandb.init(mode="offline", dir=str(out), project="trainplan", name=out.name, config=cfg.to_dict())

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "ok" else 1)


SINKS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}


def _flat(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class Trackers:
    """The run's open loggers (none on ranks other than the main one)."""

    def __init__(self, sinks: list | None = None) -> None:
        self.sinks = sinks or []

    @classmethod
    def open(cls, cfg: C.RunConfig, *, main: bool) -> Trackers:
        """Open train.report_to's loggers under cfg.train.output_dir (after `require`)."""
        if not main:
            return cls()
        out = Path(cfg.train.output_dir)
        sinks = []
        try:
            for name in cfg.train.report_to:
                if name in SINKS:
                    sinks.append(SINKS[name](out, cfg))
        except BaseException:
            cls(sinks).close("error")
            raise
        return cls(sinks)

    def step(self, entry: dict) -> None:
        self.log(step_scalars(entry), entry["step"])

    def evaluation(self, step: int, metrics: dict) -> None:
        self.log(eval_scalars(metrics), step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(scalars, step)

    def close(self, status: str = "ok") -> None:
        """Flush and close every logger; status: ok, interrupted or error."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(status)
