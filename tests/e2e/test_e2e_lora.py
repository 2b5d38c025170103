"""Multi-LoRA through tritonserver: a tiny Llama served with two PEFT adapters listed in its
multi_lora.json. Concurrent greedy requests of both adapters and of the base model return the
token ids and text of transformers + PEFT; an unknown lora_name is refused naming the known
ones; the OpenAI frontend lists the adapters in /v1/models and serves model="<adapter>"
(the engine-level tests are tests/engine/test_lora.py).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import transformers

from tests.checkpoints import hf_greedy, make_random_adapter
from tests.e2e.openai_frontend import run_frontend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
MAX_TOKENS = 10
ADAPTERS = {"all-r8": dict(rank=8, seed=1), "qv-r16": dict(rank=16, seed=2, target_modules=("q_proj", "v_proj"))}


@pytest.fixture(scope="module")
def lora_server(tritonserver, tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-triton")
    adapters = {name: make_random_adapter(str(root / name), tiny_checkpoint, **kw) for name, kw in ADAPTERS.items()}
    parameters = {"model_path": tiny_checkpoint, "max_num_seqs": "8", "kv_cache_memory_mb": "64", "max_model_len": "256",
                  "max_lora_rank": "16", "max_loras": "2"}
    with tritonserver({"llm": parameters}, model_files={"llm": {"multi_lora.json": json.dumps(adapters)}}) as server:
        yield server, tiny_checkpoint, adapters


@pytest.mark.e2e
def test_lora_through_tritonserver_and_the_openai_frontend(lora_server):
    import tritonclient.grpc as grpcclient

    from client.triton import make_inputs, stream_generate, text_of

    server, base, adapters = lora_server
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = {None: hf_greedy(base, ids, MAX_TOKENS)}
    for name, path in adapters.items():
        expected[name] = hf_greedy(base, ids, MAX_TOKENS, adapter_dir=path)
        assert expected[name] != expected[None]
    jobs = [(name, i) for name in expected for i in range(len(PROMPTS))]

    def ask(job, sampling_extra=None):
        name, i = job
        sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0,
                    **({"lora_name": name} if name else {}), **(sampling_extra or {})}
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            inputs = make_inputs(PROMPTS[i], sampling, stream=False, returns=("return_logprobs",))
            responses = list(stream_generate(client, "llm", inputs, request_id=f"{name}-{i}", timeout_s=300))
        finally:
            client.close()
        entries = json.loads(responses[0].as_numpy("logprobs").reshape(-1)[0])
        return [int(next(iter(entry))) for entry in entries], text_of(responses[0])

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(ask, jobs))
    for (name, i), (token_ids, text) in zip(jobs, results):
        want = expected[name][i]
        assert token_ids == want, (name, i)
        assert text == tokenizer.decode(want, skip_special_tokens=True)

    with pytest.raises(Exception) as err:
        ask(("nope", 0))
    assert "lora_name: unknown LoRA adapter 'nope'; known adapters: ['all-r8', 'qv-r16']" in str(err.value)

    repository = server.log_path.parent / "model_repository"
    with run_frontend(server.grpc_url, "--model-repository", str(repository)) as frontend:
        client = frontend.openai()
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"llm", "all-r8", "qv-r16"}
        assert cards["qv-r16"].model_extra.get("parent") == "llm"
        completion = client.completions.create(model="qv-r16", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert completion.model == "qv-r16"
        assert completion.choices[0].text == tokenizer.decode(expected["qv-r16"][1], skip_special_tokens=True)
