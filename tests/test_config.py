import pytest

from trainplan import config as C
from trainplan.errors import ConfigError


def test_toml_round_trip(tmp_path):
    cfg = C.load(
        None,
        [
            "mode=lora",
            "lora.r=16",
            "batch.seq_len=2048",
            "hardware.gpus=2xH100-80GB",
            'lora.target_modules=["q_proj", "k_proj", "v_proj"]',
        ],
    )
    path = tmp_path / "run.toml"
    path.write_text(C.to_toml(cfg))
    assert C.load(path) == cfg
    assert cfg.lora.target_modules == ["q_proj", "k_proj", "v_proj"]


def test_precedence_file_then_flags_then_set(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('mode = "lora"\n[batch]\nseq_len = 1024\nmicro_batch_size = 2\n')
    cfg = C.load(path, ["batch.seq_len=4096"], {"batch.seq_len": 2048, "batch.micro_batch_size": 8})
    assert (cfg.mode, cfg.batch.seq_len, cfg.batch.micro_batch_size) == ("lora", 4096, 8)


def test_unknown_section_and_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[bacth]\nseq_len = 4\n")
    with pytest.raises(ConfigError, match="bacth: unknown section or setting; did you mean 'batch'"):
        C.load(path)
    path.write_text("[optim]\nlearning_rate = 1e-4\n")
    with pytest.raises(ConfigError, match=r"optim\.learning_rate: unknown setting"):
        C.load(path)


def test_invalid_toml_and_missing_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("mode = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        C.load(path)
    with pytest.raises(ConfigError, match="config: no such file"):
        C.load(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lora.r=0", r"lora\.r: must be an integer >= 1"),
        ("lora.dropout=1.5", r"lora\.dropout: must be a number in \[0, 1\)"),
        ("optim.lr=-1", r"optim\.lr: must be positive"),
        ("precision=fp8", r"run\.precision: unknown value 'fp8'"),
        ("parallel.strategy=zero4", r"parallel\.strategy: unknown value 'zero4'"),
        ("hardware.allocator_reserve=2", r"hardware\.allocator_reserve: must be a number in \[0, 1\)"),
        ("batch.seq_len=true", r"batch\.seq_len: must be an integer \(got True\)"),
    ],
)
def test_validation_names_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        C.load(None, [override])


def test_fsdp_is_an_alias_of_zero3():
    assert C.load(None, ["parallel.strategy=fsdp"]).parallel.strategy == "zero3"


@pytest.mark.parametrize(
    "setting", ["train.max_grad_norm=nan", "optim.lr=inf", "guard.threshold=nan", "hardware.safety_margin=-inf"]
)
def test_nan_and_inf_are_refused_naming_the_field(setting):
    """nan passes every range check (nan <= 0 is False): `max_grad_norm = nan` once trained to NaN
    weights and ended with exit 0 and a PASS."""
    key = setting.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number \(got -?(nan|inf)\); give a finite value"):
        C.load(None, [setting])


def test_every_problem_is_reported_at_once(tmp_path, capsys):
    """Five independent mistakes in one config: five lines, one per field, exit 2, nothing run."""
    from trainplan.cli import main

    cfg = tmp_path / "bad.toml"
    cfg.write_text(
        'mode = "lorra"\n[optim]\nlr = -1\n[batch]\nseq_len = 0\n[guard]\nthreshold = nan\n[train]\nbogus = 1\n'
    )
    assert main(["plan", str(cfg)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    fields = [line.split(": error: ", 1)[1].split(":", 1)[0] for line in lines]
    assert sorted(fields) == ["batch.seq_len", "guard.threshold", "optim.lr", "run.mode", "train.bogus"], lines
    with pytest.raises(ConfigError) as e:  # a caller catching one ConfigError still catches them all
        C.load(str(cfg))
    assert len(e.value.errors) == 5


def test_settings_that_conflict_only_together_are_still_refused():
    with pytest.raises(ConfigError, match="guard.min_history"):
        C.load(None, ["guard.window=4", "guard.min_history=9"])


def test_settings_checked_together_are_judged_with_the_whole_section():
    """A check that reads two settings (min_history against window, eval_fraction 0 against
    eval_source) sees the section's values, not the other setting's default."""
    cfg = C.load(None, ["guard.window=256", "guard.min_history=200"])
    assert (cfg.guard.window, cfg.guard.min_history) == (256, 200)
    assert C.load(None, ["data.eval_fraction=0", "data.eval_source=eval.jsonl"]).data.eval_fraction == 0
    with pytest.raises(ConfigError, match=r"^guard\.min_history: 200 exceeds guard\.window \(128\)"):
        C.load(None, ["guard.min_history=200"])
