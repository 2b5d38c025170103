"""Multi-LoRA: greedy output with an adapter is token-identical to transformers + PEFT
(`PeftModel.from_pretrained`, unmerged) on the same checkpoint, in batches that mix three
adapters and the base model under continuous arrivals, chunked prefill and preemption;
`max_loras` holds further adapters back without starving them; the prefix cache never
hands one adapter's blocks to another; bad adapters and unknown names are refused.

Tiny random base model and random PEFT adapters (backend/models/random_checkpoint.py);
one `slow` test runs the default checkpoint with a random rank-8 adapter.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from safetensors.torch import load_file, save_file

import kernels
from backend.config import EngineConfig, read_multi_lora
from backend.engine import LLMEngine
from backend.lora import LoRAError, load_adapter
from backend.models.loader import load_arch
from backend.paths import DEFAULT_CHECKPOINT
from backend.request import RequestError, SamplingParams
from tests.checkpoints import hf_greedy, make_random_adapter
from tests.engine.test_engine_equivalence import probe_logprobs, run_engine, spread_arrivals

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW = 12
_rng = random.Random(27)
LENGTHS = [1, 3, 9, 16, 17, 23, 33, 40, 5, 12, 48, 7]
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]
# Three adapters of different ranks and targets: all seven modules; the attention's q and v
# only (k of the fused q|k|v gets none); the MLP and o_proj at rank 64.
ADAPTERS = {
    "all-r8": dict(rank=8, seed=1),
    "qv-r16": dict(rank=16, seed=2, target_modules=("q_proj", "v_proj")),
    "mlp-r64": dict(rank=64, seed=3, target_modules=("gate_proj", "up_proj", "down_proj", "o_proj")),
}
NAMES = [None, *ADAPTERS]
CONFIG = dict(max_lora_rank=64, max_loras=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_random_adapter(str(root / name), tiny_checkpoint, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint, adapters) -> dict[tuple, list[int]]:
    """(adapter name or None, prompt) -> transformers (+ PEFT) greedy tokens."""
    table = {}
    for name in NAMES:
        outs = hf_greedy(tiny_checkpoint, PROMPTS, MAX_NEW, adapter_dir=adapters[name] if name else None)
        table.update({(name, tuple(p)): o for p, o in zip(PROMPTS, outs)})
    return table


def _run(tiny_checkpoint, adapters, oracle, names, arrivals=None, **config):
    max_tokens = [MAX_NEW - (i * 5) % 7 for i in range(len(PROMPTS))]
    arrivals = arrivals if arrivals is not None else spread_arrivals(len(PROMPTS), every=1)
    engine, streamed, by_id = run_engine(tiny_checkpoint, PROMPTS, max_tokens, arrivals, lora_names=names,
                                         lora_modules=adapters, **{**CONFIG, **config})
    _assert(oracle, names, streamed, by_id, max_tokens)
    return engine


def test_adapters_change_the_output(oracle):
    """The oracle is worth comparing against: every adapter changes most prompts' tokens."""
    for name in ADAPTERS:
        changed = sum(oracle[(name, tuple(p))] != oracle[(None, tuple(p))] for p in PROMPTS)
        assert changed >= len(PROMPTS) // 2, f"{name} changed only {changed} of {len(PROMPTS)} outputs"


# triton-on-cpu: the CUDA path's SGMV kernels (in Triton's interpreter), as the engine calls them.
@pytest.mark.parametrize("device", ["cpu", pytest.param("triton-on-cpu", marks=pytest.mark.slow)])
def test_mixed_batch_of_three_adapters_and_base(tiny_checkpoint, adapters, oracle, device):
    names = [NAMES[i % 4] for i in range(len(PROMPTS))]
    engine = _run(tiny_checkpoint, adapters, oracle, names, max_num_seqs=8, device=device)
    assert engine.max_running >= 4


def test_warm_up_runs_the_lora_kernels(tiny_checkpoint, adapters):
    """With adapters loaded, `LLMEngine.warm_up` (at load on CUDA) also launches the SGMV
    kernels, here through Triton's interpreter."""
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", lora_modules=adapters,
                                    max_num_batched_tokens=64, **CONFIG))
    engine.model.cpu_layers = None   # the CUDA path's per-module forward pass
    delta = kernels.lora_delta_triton
    launches = []
    kernels.lora_delta_triton = lambda *args, **kw: launches.append(1) or delta(*args, **kw)
    try:
        with kernels.triton_kernels_on_cpu():
            engine.warm_up()
    finally:
        kernels.lora_delta_triton = delta
    assert launches


def test_one_adapter_alone_at_once(tiny_checkpoint, adapters, oracle):
    """All arrive at step 0, one adapter: every step is one segment."""
    _run(tiny_checkpoint, adapters, oracle, ["qv-r16"] * len(PROMPTS), arrivals=[0] * len(PROMPTS), max_num_seqs=16)


def test_chunked_prefill(tiny_checkpoint, adapters, oracle):
    names = [NAMES[(i + 1) % 4] for i in range(len(PROMPTS))]
    chunks = []

    def record(engine):
        schedule = engine.scheduler.schedule

        def wrapped():
            plan = schedule()
            chunks.extend(n for _, n in plan.scheduled)
            return plan

        engine.scheduler.schedule = wrapped

    max_tokens = [MAX_NEW - (i * 5) % 7 for i in range(len(PROMPTS))]
    engine, streamed, by_id = run_engine(tiny_checkpoint, PROMPTS, max_tokens, spread_arrivals(len(PROMPTS), every=1),
                                         on_engine=record, lora_names=names, lora_modules=adapters,
                                         long_prefill_token_threshold=7, max_num_batched_tokens=30, max_num_seqs=6,
                                         **CONFIG)
    assert max(chunks) == 7
    _assert(oracle, names, streamed, by_id, max_tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(tiny_checkpoint, adapters, oracle, mode):
    names = [NAMES[(i + 2) % 4] for i in range(len(PROMPTS))]
    max_tokens = [MAX_NEW - (i * 5) % 7 for i in range(len(PROMPTS))]
    engine, streamed, by_id = run_engine(tiny_checkpoint, PROMPTS, max_tokens, spread_arrivals(len(PROMPTS), every=1),
                                         lora_names=names, lora_modules=adapters, max_num_seqs=6, block_size=8,
                                         num_kv_blocks=14, long_prefill_token_threshold=13, preemption_mode=mode,
                                         swap_space_mb=1, max_preemptions=3, max_lora_rank=64, max_loras=4)
    assert engine.stats.totals.preemptions > 0
    _assert(oracle, names, streamed, by_id, max_tokens)


def _assert(oracle, names, streamed, by_id, max_tokens):
    mismatches = []
    for rid, tokens in streamed.items():
        i = int(rid[1:])
        want = oracle[(names[i], tuple(by_id[rid]))][: max_tokens[i]]
        if tokens != want:
            mismatches.append(f"{rid} ({names[i]}, prompt of {len(by_id[rid])}): {tokens} != {want}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("max_loras", [1, 2])
def test_max_loras_limits_adapters_per_step_without_starving(tiny_checkpoint, adapters, oracle, max_loras):
    names = [NAMES[1 + i % 3] if i % 4 else None for i in range(len(PROMPTS))]
    seen = []

    def record(engine):
        schedule = engine.scheduler.schedule

        def wrapped():
            plan = schedule()
            seen.append({r.lora_name for r, _ in plan.scheduled if r.lora_name is not None})
            return plan

        engine.scheduler.schedule = wrapped

    max_tokens = [MAX_NEW - (i * 5) % 7 for i in range(len(PROMPTS))]
    engine, streamed, by_id = run_engine(tiny_checkpoint, PROMPTS, max_tokens, [0] * len(PROMPTS), on_engine=record,
                                         lora_names=names, lora_modules=adapters, max_num_seqs=12,
                                         max_lora_rank=64, max_loras=max_loras, num_kv_blocks=256)
    assert max(len(s) for s in seen) == max_loras
    _assert(oracle, names, streamed, by_id, max_tokens)  # every request finished, correctly


def test_prefix_cache_keys_on_the_adapter(tiny_checkpoint, adapters, oracle):
    """The same 40-token prompt under the base model, two adapters, then each again: blocks
    are reused only under the adapter that computed them."""
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", lora_modules=adapters,
                                    **CONFIG))
    prompt = PROMPTS[7]
    assert len(prompt) == 40
    hits = []
    for k, name in enumerate([None, "all-r8", "qv-r16", "all-r8", None, "qv-r16"]):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, lora_name=name)
        request = engine.add_request(f"p{k}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        hits.append(request.num_cached_prompt_tokens)
        assert request.output_token_ids == oracle[(name, tuple(prompt))]
    assert hits == [0, 0, 0, 32, 32, 32]


def test_kv_events_name_the_adapter_a_block_was_computed_under(tiny_checkpoint, adapters):
    """vLLM's BlockStored carries lora_id (from 1) and lora_name, so a cache-aware router keeps
    one adapter's blocks apart from another's; a first block has no parent under any adapter."""
    from backend.kv_events import BlockStored

    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", lora_modules=adapters,
                                    **CONFIG))
    engine.kv.pool.events = []  # record, as kv_events_endpoint does, without a socket
    for k, name in enumerate([None, "qv-r16"]):
        engine.add_request(f"e{k}", PROMPTS[7], SamplingParams(temperature=0.0, max_tokens=2, lora_name=name))
        while engine.has_unfinished():
            engine.step()
    stored = [e for e in engine.kv.pool.take_events() if isinstance(e, BlockStored)]
    base_blocks = [e for e in stored if e.lora_name is None]
    adapter_blocks = [e for e in stored if e.lora_name == "qv-r16"]
    assert len(base_blocks) == len(adapter_blocks) == 2 and len(stored) == 4
    assert {e.lora_id for e in base_blocks} == {None}
    assert {e.lora_id for e in adapter_blocks} == {engine.lora_adapters["qv-r16"] + 1}
    assert base_blocks[0].parent_block_hash is None and adapter_blocks[0].parent_block_hash is None
    assert adapter_blocks[1].parent_block_hash == adapter_blocks[0].block_hashes[0]
    assert base_blocks[0].block_hashes != adapter_blocks[0].block_hashes  # same tokens, other adapter


def test_unknown_lora_name_lists_the_known_ones(tiny_checkpoint, adapters):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", lora_modules=adapters, **CONFIG))
    with pytest.raises(RequestError) as err:
        engine.add_request("x", [5, 6, 7], SamplingParams(lora_name="nope"))
    assert err.value.code == RequestError.INVALID_ARG
    assert str(err.value) == "lora_name: unknown LoRA adapter 'nope'; known adapters: ['all-r8', 'mlp-r64', 'qv-r16']"
    plain = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=16))
    with pytest.raises(RequestError, match="lora_name: unknown LoRA adapter 'all-r8'; this model serves no LoRA"):
        plain.add_request("y", [5, 6, 7], SamplingParams(lora_name="all-r8"))


def _copy_adapter(src: str, dest, config_changes=None, tensors=None) -> str:
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(config_changes or {})
    with open(os.path.join(dest, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    weights = load_file(os.path.join(src, "adapter_model.safetensors"))
    if tensors is not None:
        weights = tensors(weights)
    save_file(weights, os.path.join(dest, "adapter_model.safetensors"))
    return str(dest)


def test_bad_adapters_are_refused_at_load(tiny_checkpoint, adapters, tmp_path):
    arch, _ = load_arch(tiny_checkpoint)
    with pytest.raises(LoRAError, match=r"r=64: exceeds max_lora_rank=16"):
        load_adapter("mlp-r64", adapters["mlp-r64"], arch, max_lora_rank=16)
    dora = _copy_adapter(adapters["all-r8"], tmp_path / "dora", {"use_dora": True})
    with pytest.raises(LoRAError, match=r"use_dora=True: only use_dora=False"):
        load_adapter("dora", dora, arch, 64)
    lm_head = _copy_adapter(adapters["all-r8"], tmp_path / "lm_head", {"target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(LoRAError, match=r"target_modules=\['lm_head'\]: supported target modules: q_proj"):
        load_adapter("lm_head", lm_head, arch, 64)

    def widen(weights):
        key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
        weights[key] = weights[key].repeat(1, 2)
        return weights

    wrong = _copy_adapter(adapters["all-r8"], tmp_path / "wrong", tensors=widen)
    with pytest.raises(LoRAError, match=r"layers\.1\.mlp\.down_proj\.lora_A\.weight has shape \(8, 256\); "
                                        r"r=8 and the base model imply \(8, 128\)"):
        load_adapter("wrong", wrong, arch, 64)

    def drop_b(weights):
        del weights["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
        return weights

    half = _copy_adapter(adapters["all-r8"], tmp_path / "half", tensors=drop_b)
    with pytest.raises(LoRAError, match="layer 0 k_proj has lora_A but no lora_B"):
        load_adapter("half", half, arch, 64)
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_adapter("missing", str(tmp_path / "nothing"), arch, 64)
    # Through the engine: the load fails, naming the adapter.
    with pytest.raises(LoRAError, match="LoRA adapter 'mlp-r64'"):
        LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", lora_modules=adapters, num_kv_blocks=16))


def test_multi_lora_json_in_the_model_folder(tiny_checkpoint, adapters, tmp_path):
    model_folder = tmp_path / "llm"
    (model_folder / "1").mkdir(parents=True)
    os.symlink(adapters["all-r8"], tmp_path / "adapter-link")
    (model_folder / "multi_lora.json").write_text(json.dumps({"a": "../adapter-link", "b": adapters["qv-r16"]}))
    config = EngineConfig.from_parameters({"model_path": tiny_checkpoint}, str(model_folder / "1"))
    assert config.lora_modules == {"a": str(tmp_path / "adapter-link"), "b": adapters["qv-r16"]}
    off = EngineConfig.from_parameters({"model_path": tiny_checkpoint, "enable_lora": "false"}, str(model_folder / "1"))
    assert off.lora_modules is None
    with pytest.raises(ValueError, match="enable_lora=true but there is no"):
        EngineConfig.from_parameters({"model_path": tiny_checkpoint, "enable_lora": "true"}, str(tmp_path / "other" / "1"))
    (tmp_path / "bad.json").write_text('["a"]')
    with pytest.raises(ValueError, match="must be a JSON object"):
        read_multi_lora(str(tmp_path / "bad.json"))


@pytest.mark.slow
def test_default_model_with_a_rank8_adapter(tmp_path_factory):
    """SmolLM2-135M-Instruct with a random rank-8 adapter on every module, beside the base."""
    adapter = make_random_adapter(str(tmp_path_factory.mktemp("smollm-lora") / "r8"), str(DEFAULT_CHECKPOINT),
                                  rank=8, seed=5)
    prompts = [[1, 9690, 314, 253, 1378, 28, 1041], PROMPTS[4], PROMPTS[6]]
    names = [None, "r8", "r8", None, "r8", None]
    all_prompts = prompts + prompts
    want_base = hf_greedy(str(DEFAULT_CHECKPOINT), prompts, MAX_NEW)
    want_lora = hf_greedy(str(DEFAULT_CHECKPOINT), prompts, MAX_NEW, adapter_dir=adapter)
    assert want_base != want_lora
    max_tokens = [MAX_NEW] * len(all_prompts)
    engine, streamed, by_id = run_engine(str(DEFAULT_CHECKPOINT), all_prompts, max_tokens, [0, 0, 1, 1, 2, 2],
                                         lora_names=names, lora_modules={"r8": adapter}, max_loras=1,
                                         num_kv_blocks=128, max_lora_rank=8)
    for i in range(len(all_prompts)):
        want = (want_lora if names[i] else want_base)[i % len(prompts)]
        assert streamed[f"r{i}"] == want, (i, names[i])


def test_stats_report_running_and_waiting_adapters(tiny_checkpoint, adapters):
    """vLLM's lora_requests_info labels come from the engine's snapshot."""
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", lora_modules=adapters,
                                    max_lora_rank=64, max_loras=1, num_kv_blocks=64))
    assert (engine.stats.running_lora_adapters, engine.stats.waiting_lora_adapters) == ((), ())
    for k, name in enumerate(["qv-r16", None, "all-r8", "qv-r16"]):
        engine.add_request(f"s{k}", PROMPTS[k], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                               lora_name=name))
    engine.step()
    stats = engine.stats
    assert stats.running_lora_adapters == ("qv-r16",) and stats.max_loras == 1
    assert stats.waiting_lora_adapters == ("all-r8", "qv-r16")
    assert stats.num_running == 2  # the base request ran beside qv-r16; all-r8 holds the queue
    while engine.has_unfinished():
        engine.step()
    assert (engine.stats.running_lora_adapters, engine.stats.waiting_lora_adapters) == ((), ())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_logprobs_with_adapters(tiny_checkpoint, adapters, dtype):
    """With batch_invariant on, a request's logprobs under an adapter are bitwise the same
    alone and in a batch where its adapter's segment also holds other requests' tokens and
    other adapters' segments surround it."""
    def logprobs_beside(others):
        engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype=dtype, lora_modules=adapters,
                                        batch_invariant=True, **CONFIG))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, lora_name="all-r8")
        return probe_logprobs(engine, PROMPTS[10], params, [
            (prompt, SamplingParams(temperature=0.0, max_tokens=3 + k % 5, ignore_eos=True, lora_name=name))
            for k, (name, prompt) in enumerate(others)])

    alone = logprobs_beside([])
    mixed = logprobs_beside([(NAMES[k % 4], PROMPTS[k]) for k in range(9)])
    assert len(alone) == 8 and alone == mixed


def test_random_adapter_from_the_command_line(tiny_checkpoint, tmp_path, capsys):
    from tools.random_checkpoint import main

    dest = str(tmp_path / "cli-r4")
    assert main([dest, "--lora-for", tiny_checkpoint, "--rank", "4", "--target-modules", "q_proj", "down_proj"]) == 0
    assert capsys.readouterr().out.strip() == dest
    adapter = load_adapter("cli", dest, load_arch(tiny_checkpoint)[0], max_lora_rank=4)
    assert adapter.rank == 4 and adapter.target_modules == ["down_proj", "q_proj"]
    assert adapter.scaling == 2.0  # lora_alpha defaults to 2r
    assert all(b.abs().sum() > 0 for _, b in adapter.weights.values()), "B must be nonzero to change anything"


def test_cpu_decoder_layers_add_the_adapters_as_the_modules_do(tiny_checkpoint, adapters):
    """With adapters installed each layer still runs as one C++ call (kernels.cpu_decoder_layer),
    adding every segment's delta as lora_delta_cpu does: the same tokens and the same
    cumulative logprobs, to the bit, as the modules, on a batch of three adapters and base."""
    names = [NAMES[i % 4] for i in range(len(PROMPTS))]

    def run(fused: bool) -> list[tuple[list[int], float]]:
        engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, lora_modules=adapters, max_num_seqs=16, **CONFIG))
        assert engine.model.cpu_layers is not None
        if not fused:
            engine.model.cpu_layers = None
        params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0, lora_name=name)
                  for name in names]
        return [(r.output_token_ids, r.cumulative_logprob) for r in engine.generate(PROMPTS, params)]

    assert run(fused=True) == run(fused=False)
