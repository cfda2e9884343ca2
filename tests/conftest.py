import pytest

from trainplan import config as C


@pytest.fixture(scope="session", autouse=True)
def _registry(tmp_path_factory):
    """Runs made by the tests go to a registry of their own, never the user's."""
    import os

    old = os.environ.get("TRAINPLAN_REGISTRY")
    os.environ["TRAINPLAN_REGISTRY"] = str(tmp_path_factory.mktemp("registry") / "runs.sqlite")
    yield
    if old is None:
        os.environ.pop("TRAINPLAN_REGISTRY", None)
    else:
        os.environ["TRAINPLAN_REGISTRY"] = old


@pytest.fixture
def make_cfg():
    """A RunConfig from key=value settings, through the same path as the CLI's --set."""

    def make(**settings):
        return C.load(None, [], {k.replace("__", "."): v for k, v in settings.items()})

    return make


@pytest.fixture(scope="session")
def tiny_llama():
    """A 2-layer Llama config (hidden 64, GQA 4/2, vocab 256) as transformers' config.json dict."""
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
