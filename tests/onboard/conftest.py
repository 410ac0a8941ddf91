import pytest

pytest.importorskip("transformers")

from onboard_helpers import save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def dsv3_dir(tmp_path_factory):
    return save_tiny("deepseek_v3", tmp_path_factory.mktemp("dsv3"))
