import pytest

from trainplan import config as C


@pytest.fixture
def make_cfg():
    """A RunConfig from key=value settings, through the same path as the CLI's --set."""

    def make(**settings):
        return C.load(None, [], {k.replace("__", "."): v for k, v in settings.items()})

    return make
