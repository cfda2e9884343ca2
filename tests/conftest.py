import json

import pytest

from trainplan import config as C
from trainplan.spec.model import preset_config

# The files that take longest, longest first (seconds of one run on the 2-core machine, 2026-12-02:
# 492, 489, 168, 129, 110, 104, 98, 85). `make test` hands files to its two workers in collection order
# (--dist loadfile --no-loadscope-reorder): started first, they run beside the many short files instead
# of leaving one worker alone with a 490-second file at the end, as xdist's default order (the files
# with the most tests first) did.
LONGEST_FIRST = (
    "tests/run/test_fault_injection.py",
    "tests/run/test_distributed.py",
    "tests/run/test_accept.py",
    "tests/run/test_tensor_parallel.py",
    "tests/run/test_checkpoint.py",
    "tests/run/test_guard.py",
    "tests/run/test_engine.py",
    "tests/run/test_pipeline_parallel.py",
    "tests/test_readme.py",
    "tests/run/test_compile.py",
)


def pytest_collection_modifyitems(items):
    order = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::")[0], len(order)))  # stable: the rest as collected


def pytest_collection_finish(session):
    """What collection imported (torch, transformers: hundreds of thousands of objects that live as long
    as the worker) leaves the garbage collector's sight, as a trainplan process's start-up does
    (trainplan/startup.py): the tests' own collections walk only what the tests make."""
    import gc

    gc.freeze()


# Process launches per test file (issue 47): every subprocess.Popen the suite makes, as torchrun (a
# torch.distributed.run launcher and its ranks), trainplan (one `python -m trainplan` process) or other
# (browsers, SLURM daemons, scripts), and the CPU-seconds each file's tests spend: the worker's own and
# its children's (getrusage: a child counts once waited for, a torchrun launcher with the ranks it
# waited for; a process orphaned by a SIGKILL of its parent is not counted). On two cores the suite's
# time is its CPU-seconds over two at best. Printed in the terminal summary; xdist workers send theirs to
# the controller (workeroutput), which prints the whole suite's.
LAUNCHES: dict[str, dict[str, float]] = {}
KINDS = ("torchrun", "trainplan", "other", "cpu_s")
_CURRENT_FILE = ["(outside any test: xdist workers, collection)"]


def _launch_kind(args) -> str:
    argv = [str(a) for a in ([args] if isinstance(args, (str, bytes)) else args)]
    text = " ".join(argv)
    if "torch.distributed.run" in text or any(a.endswith("torchrun") for a in argv):
        return "torchrun"
    if "-m trainplan" in text or any(a.endswith("/trainplan") for a in argv):
        return "trainplan"
    return "other"


def pytest_configure(config):
    import subprocess

    original = subprocess.Popen.__init__

    def counted(self, args, *rest, **kwargs):
        original(self, args, *rest, **kwargs)  # counted once started: a refused launch is none
        _file_counts(_CURRENT_FILE[0])[_launch_kind(args)] += 1

    subprocess.Popen.__init__ = counted
    config._launch_counter = (subprocess.Popen, original)


def _file_counts(path: str) -> dict[str, float]:
    return LAUNCHES.setdefault(path, dict.fromkeys(KINDS, 0))


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _CURRENT_FILE[0] = item.nodeid.split("::")[0]
    start = _cpu_seconds()
    try:
        return (yield)
    finally:
        _file_counts(_CURRENT_FILE[0])["cpu_s"] += _cpu_seconds() - start


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the counts to the controller
        session.config.workeroutput["launches"] = json.dumps(LAUNCHES)


def pytest_testnodedown(node, error):  # xdist's controller, as each worker finishes
    for path, kinds in json.loads(getattr(node, "workeroutput", {}).get("launches", "{}")).items():
        mine = _file_counts(path)
        for kind, n in kinds.items():
            mine[kind] += n


def pytest_terminal_summary(terminalreporter):
    if hasattr(terminalreporter.config, "workeroutput") or not LAUNCHES:
        return
    rows = sorted(LAUNCHES.items(), key=lambda kv: -kv[1]["cpu_s"])
    total = {k: sum(v[k] for v in LAUNCHES.values()) for k in KINDS}
    terminalreporter.section("process launches and CPU-seconds per file (torchrun / trainplan / other / CPU s)")
    for path, n in rows:
        if sum(n[k] for k in KINDS[:3]) or n["cpu_s"] >= 5:
            line = f"{n['torchrun']:4.0f} {n['trainplan']:4.0f} {n['other']:4.0f} {n['cpu_s']:7.0f}  {path}"
            terminalreporter.write_line(line)
    launches = sum(total[k] for k in KINDS[:3])
    terminalreporter.write_line(
        f"{total['torchrun']:4.0f} {total['trainplan']:4.0f} {total['other']:4.0f} {total['cpu_s']:7.0f}  "
        f"in all: {launches:.0f} launches, {total['cpu_s']:.0f} CPU-seconds (the files under 5 CPU-s without a "
        "launch not listed)"
    )


@pytest.fixture(scope="session", autouse=True)
def _registry(tmp_path_factory):
    """In-process runs made by the tests go to a registry of their own, never the user's (runs in
    subprocesses pass --registry themselves)."""
    from trainplan.verify import registry

    old = registry.DEFAULT
    registry.DEFAULT = str(tmp_path_factory.mktemp("registry") / "runs.sqlite")
    yield
    registry.DEFAULT = old


@pytest.fixture(autouse=True)
def _processes_are_marked(request, monkeypatch):
    """A test that starts a process (a CLI subprocess, torchrun, a spawned rank, a browser) must
    carry the `multiprocess` marker, so `make test-fast` (-m "not slow and not multiprocess")
    really starts none."""
    if request.node.get_closest_marker("multiprocess"):
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts a process: mark it @pytest.mark.multiprocess")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(scope="session")
def bench_script():
    """Load a script of bench/ as a module, by name: some tests check its functions or its cases."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def make_cfg():
    """A RunConfig from key=value settings, through the same path as the CLI's --set."""

    def make(**settings):
        return C.load(None, [], {k.replace("__", "."): v for k, v in settings.items()})

    return make


@pytest.fixture(scope="session")
def tiny_llama():
    """The tiny-llama preset (2 layers, hidden 64, GQA 4/2, vocab 256) as transformers' config.json
    dict: the same tiny model `trainplan devices` steps in its determinism check."""
    return preset_config("tiny-llama")


# The tiny-llama preset, holding the embedded SmolLM2 tokenizer's 49,152-token vocabulary.
TINY = {
    **preset_config("tiny-llama"),
    "intermediate_size": 128,
    "vocab_size": 49152,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny model config, a small text corpus (six documents), and a base set of overrides."""
    root = tmp_path_factory.mktemp("tiny")
    (root / "config.json").write_text(json.dumps(TINY))
    corpus = root / "corpus"
    corpus.mkdir()
    import pydoc_data.topics as topics

    for name in sorted(topics.topics)[:6]:
        (corpus / f"{name}.txt").write_text(topics.topics[name][:6000])
    # the same tiny model with saved weights, so runs on different rank counts start identical
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    model.save_pretrained(root / "weights")
    from trainplan.run.weights import gguf_cache
    from trainplan.spec.model import default_gguf_path

    tokenizer_dir = gguf_cache(default_gguf_path(), "~/.cache/trainplan")
    transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(root / "weights")
    base = [
        f"model.source={root / 'config.json'}",
        "model.init=random",
        f"data.source={corpus}",
        "data.eval_fraction=0.34",
        "batch.seq_len=32",
        "batch.micro_batch_size=4",
        "train.steps=3",
        "train.eval_batches=2",
        "optim.lr=1e-3",
        "precision=fp32",
    ]
    return root, base


@pytest.fixture(scope="session")
def small_pretrained(tiny_run, tmp_path_factory):
    """A ready model for long fine-tuning runs: a tiny Llama with its own 512-token byte-level BPE
    (trained on the corpus), pretrained for 300 steps, so 1000 fine-tuning steps take seconds."""
    import torch
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    root, _ = tiny_run
    out = tmp_path_factory.mktemp("small") / "model"
    texts = [p.read_text() for p in sorted((root / "corpus").iterdir())]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=512, min_frequency=2, special_tokens=["<eos>"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**TINY, "vocab_size": 512}))
    ids = [i for t in texts for i in tok(t)["input_ids"] + [tok.eos_token_id]]
    x = torch.tensor(ids[: len(ids) // 32 * 32]).view(-1, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        batch = x[torch.randint(0, len(x), (8,))]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def screenshot(tmp_path):
    """screenshot(html_path, height) -> {(r, g, b): pixel count} of the page rendered in headless
    Chromium (Debian's; `make test` installs it). Skips where it is missing, except in CI."""
    import os
    import shutil
    import subprocess

    def shoot(html, height: int = 2400) -> dict:
        browser = shutil.which("chromium") or shutil.which("chromium-browser")
        if browser is None:
            if os.environ.get("CI"):
                pytest.fail("chromium is not installed (make test installs it from Debian's packages)")
            pytest.skip("chromium not installed")
        shot = tmp_path / "page.png"
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size=1200,{height}"]
        proc = subprocess.run(
            [browser, *args, f"--screenshot={shot}", html.as_uri()], capture_output=True, text=True, timeout=120
        )
        assert shot.is_file(), proc.stderr[-2000:]
        from PIL import Image

        counts: dict = {}
        for n, color in Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 22):
            counts[color] = counts.get(color, 0) + n
        return counts

    return shoot


def pretrained(tiny_run, *extra) -> list[str]:
    """The tiny model from its saved weights (tiny_run's), 5 steps: the settings the data- and
    tensor-parallel tests and their shared one-process reference run."""
    root, base = tiny_run
    return [*base, f"model.source={root / 'weights'}", "model.init=auto", "train.steps=5", *extra]


def torchrun_train(out, sets: list[str], nproc: int = 2) -> dict:
    """`torchrun --standalone --nproc_per_node N -m trainplan train --set ...` into `out`; its run record."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += ["-m", "trainplan", "train", "--registry", "off"]
    for item in [*sets, f"train.output_dir={out}"]:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "record.json").read_text())


def tiny_of(tiny_run, tmp_path, config_cls, **extra) -> list[str]:
    """A tiny pretrained model of another architecture (its saved weights, the run's tokenizer) and the
    settings of a short run on it: micro-batch 4, 2 steps, its own derived-terms cache."""
    import torch
    import transformers

    root, base = tiny_run
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    small |= {"num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "max_position_embeddings": 256}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**(small | extra)))
    model.save_pretrained(tmp_path / "w")
    transformers.AutoTokenizer.from_pretrained(root / "weights").save_pretrained(tmp_path / "w")
    sets = [*base, f"model.source={tmp_path / 'w'}", "model.init=auto", "batch.micro_batch_size=4"]
    sets += ["train.steps=2", "train.eval_batches=1", "checkpoint.every=0"]
    return [*sets, f"model.cache_dir={tmp_path / 'cache'}"]


@pytest.fixture(scope="session")
def torchrun():
    """torchrun_train: a multi-rank `trainplan train` and its record (tests marked multiprocess)."""
    return torchrun_train


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """reference_run(sets, nproc=1): the record of an uninterrupted run of these settings, computed once
    a session (a worker's, under xdist) and shared by every test and file that compares against the same
    run (issue 47): in this process for one, under torchrun for more ranks (tests marked multiprocess).
    The key is the whole config the settings load to (the output directory aside), so two orders of
    the same settings share a run and nothing else does; each caller gets a copy of the record."""
    import copy

    done: dict[str, dict] = {}

    def record(sets: list[str], nproc: int = 1) -> dict:
        loaded = C.load(None, sets).to_dict()
        loaded["train"].pop("output_dir")
        key = json.dumps([nproc, loaded], sort_keys=True, default=str)
        if key not in done:
            out = tmp_path_factory.mktemp("reference")
            if nproc == 1:
                from trainplan.commands.train import execute

                done[key] = execute(C.load(None, [*sets, f"train.output_dir={out}"]), quiet=True)[0].to_json()
            else:
                done[key] = torchrun_train(out, sets, nproc)
        return copy.deepcopy(done[key])

    return record


def run_advised_entry(model_dir, sets: list[str], tmp_path, pick) -> dict:
    """Advisor parity: `advise` on `model_dir` over two CPU devices (full fine-tuning, seq 32, global
    batch 4), the first runnable row whose rung `pick` accepts written by the same function as --out,
    then run under its own `# run:` launch line; the run's record."""
    import shlex
    import subprocess
    import sys

    from trainplan import cli
    from trainplan.advise import rank
    from trainplan.advise.search import search
    from trainplan.commands.advise import request_from_args

    sets = [*sets, "data.eval_fraction=0.34", "train.steps=2", "train.eval_batches=1"]
    sets += [f"train.output_dir={tmp_path / 'run'}", "train.report_to=none"]
    argv = [str(model_dir), "--gpus", "2xcpu", "--mode", "full", "--seq", "32", "--global-batch", "4"]
    args = cli.build_parser().parse_args(["advise", *argv, *(x for s in sets for x in ("--set", s))])
    s = search(request_from_args(args))
    order = rank.ranked(s, "ladder")
    row, entry = next((i, o) for i, o in enumerate(order, 1) if pick(o.rung) and not rank.train_blocker(s, o))
    out = tmp_path / "chosen.toml"
    out.write_text(rank.out_toml(s, entry, row, len(order), "ladder", str(out)))
    launch = next(line for line in out.read_text().splitlines() if line.startswith("# run: "))[len("# run: ") :]
    words = shlex.split(launch)
    assert words[:3] == ["torchrun", "--nproc_per_node", "2"], launch
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / "run" / "record.json").read_text())
