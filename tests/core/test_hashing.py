import subprocess
import sys

import pytest

from kvelastic.core.hashing import BlockHasher


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_chained_hashes_depend_on_the_whole_prefix(algorithm):
    h = BlockHasher(algorithm)
    a = h.hash_tokens(list(range(48)), 16)
    b = h.hash_tokens([99] + list(range(1, 48)), 16)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b))          # first block differs: every hash differs
    assert h.hash_tokens(list(range(40)), 16) == a[:2]  # partial block: no hash
    assert h.hash_tokens(list(range(48)), 16, extra=("lora", 1)) != a
    assert BlockHasher(algorithm, seed=b"other").hash_tokens(list(range(16)), 16) != a[:1]


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_hashes_are_stable_across_processes(algorithm):
    code = ("from kvelastic.core.hashing import BlockHasher;"
            f"print(BlockHasher({algorithm!r}).hash_tokens(list(range(32)), 16, ('salt',))[1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": str(seed)}).stdout.strip()
            for seed in (1, 2)}
    assert outs == {BlockHasher(algorithm).hash_tokens(list(range(32)), 16, ("salt",))[1].hex()}


def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="sha256"):
        BlockHasher("md5")
