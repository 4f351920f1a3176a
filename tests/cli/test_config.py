import pathlib

import pytest

from kvelastic.config import VARIABLES, Config, markdown_table, parse_duration, parse_memory, parse_size
from kvelastic.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_defaults_parse():
    config = Config.from_env({})
    assert config.page_size == 2 * 1024**2
    assert config.memory == 0.5
    assert config.prefix_cache_max_size is None
    assert config.socket.endswith("kvelastic.sock")


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 1024**2), ("8GiB", 8 * 1024**3), ("2M", 2_000_000), ("1048576", 1048576),
    ("1.5KiB", 1536),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_memory_fraction_or_size():
    assert parse_memory("0.9") == 0.9
    assert parse_memory("40GiB") == 40 * 1024**3
    with pytest.raises(ValueError):
        parse_memory("1.5")


@pytest.mark.parametrize("text,expected", [("30s", 30.0), ("500ms", 0.5), ("5m", 300.0), ("2", 2.0)])
def test_durations(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("name,value", [
    ("KVELASTIC_MEMORY", "lots"), ("KVELASTIC_PAGE_SIZE", "3MiB"), ("KVELASTIC_BACKEND", "tpu"),
    ("KVELASTIC_PREFIX_CACHE_TTL", "soon"), ("KVELASTIC_METRICS_PORT", "99999"),
    ("KVELASTIC_ENABLE", "maybe"),
])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        Config.from_env({name: value})


def test_readme_documents_every_variable():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, "README table is stale: regenerate with `kvelastic config --markdown`"
    assert len({v.name for v in VARIABLES}) == len(VARIABLES)
