"""Seeded benchmark workloads of docs/benchmarks.md (W1-W7) and of the fair policy (W8a, W8b),
as plain request lists.

A workload is a list of `BenchRequest`: prompt token ids, output length, arrival offset,
priority and tenant. EOS is ignored so output lengths are exactly as drawn. A tenant named
in `Workload.tenant_concurrency` is a closed loop: its requests go at their arrival time
or later, when fewer than that many of its requests are in flight.

Prompts come from a prompt source. The default, `SyntheticTokens`, draws random ids that
avoid the tokenizer's special tokens, so no request stops early or changes meaning.
`TextPrompts` cuts natural text (a file, one prompt per line, or `BUILTIN_PROMPTS`) to
the lengths the workload draws, so the lengths, and thus the load, stay the workload's.

Servers take text, not ids: `attach_text` gives every request a text that the
checkpoint's tokenizer encodes to exactly its prompt ids, so a server and the in-process
engine see the same prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    priority: int = 0
    temperature: float = 0.0
    # Class label for per-class metrics (W5: "high" / "low"; W8: the tenant).
    label: str = ""
    tenant: str = "default"
    # The prompt as text, for servers; set by attach_text.
    prompt_text: str | None = None
    # The LoRA adapter the request runs with (engine systems with adapters); None: the base model.
    lora_name: str | None = None
    # Sequences sampled for the prompt (parallel sampling, W7): n * max_tokens output tokens.
    n: int = 1


@dataclass
class Workload:
    name: str
    description: str
    requests: list[BenchRequest]
    # Engine settings the workload is defined with (docs/benchmarks.md), applied to every system.
    engine_overrides: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    prompt_source: str = "synthetic"
    # Tenant -> requests it keeps in flight (a closed loop); other tenants send at arrival times.
    tenant_concurrency: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "prompts": self.prompt_source,
            "num_requests": len(self.requests),
            "total_prompt_tokens": sum(len(r.prompt_token_ids) for r in self.requests),
            "total_output_tokens": sum(r.max_tokens * r.n for r in self.requests),
            "engine_overrides": self.engine_overrides,
            **({"tenant_concurrency": self.tenant_concurrency} if self.tenant_concurrency else {}),
            **self.params,
        }


# The structured-output systems' constraint (systems.py): a JSON array of records, long enough
# (minItems) that no request completes it before its max_tokens, so constrained requests
# generate exactly as many tokens as free ones and the two runs do the same work.
BENCH_STRUCTURED_OUTPUTS = {"json": {"type": "array", "minItems": 1000, "items": {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "score": {"type": "number"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["id", "name", "score", "tags"]}}}

# Token ids well inside the vocabulary and past the special tokens at its start.
TOKEN_LOW, TOKEN_HIGH = 200, 40000


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n).tolist()


class SyntheticTokens:
    """Random ordinary token ids (the default; draws exactly as the workloads always did)."""

    name = "synthetic"

    def tokens(self, rng: np.random.Generator, n: int) -> list[int]:
        return _tokens(rng, n)

    def filler(self, rng: np.random.Generator, n: int) -> list[int]:
        return _tokens(rng, n)


# Natural prompts for text workloads when no file is given: varied topics and lengths.
BUILTIN_PROMPTS = [
    "What is the capital of France, and why did it become the capital?",
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short poem about the sea at night.",
    "Give me three tips for learning a new language as an adult.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do vaccines train the immune system?",
    "Describe a typical day in the life of a medieval farmer.",
    "What are the main differences between a virus and a bacterium?",
    "Write a friendly email inviting a colleague to lunch next week.",
    "Why is the sky blue during the day and red at sunset?",
    "List some healthy breakfast ideas that take less than ten minutes.",
    "Explain what a black hole is to a ten-year-old.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "How does compound interest work? Give an example with numbers.",
    "Tell me a story about a robot who learns to paint.",
    "What were the causes of the First World War?",
    "Describe the water cycle and why it matters for agriculture.",
    "How can I make my small garden attract more bees and butterflies?",
    "Explain the rules of chess for someone who has never played.",
    "What is photosynthesis, and which parts of a plant are involved?",
    "Write a product description for a handmade wooden chair.",
    "Why do cats purr, and what does it mean?",
    "Give a short history of the printing press and its effects on Europe.",
    "How do airplanes stay in the air?",
    "What are good ways to stay focused while working from home?",
    "Describe the taste of a ripe mango to someone who has never eaten one.",
    "Explain the difference between weather and climate.",
    "Write a dialogue between a teacher and a curious student about the moon.",
    "What makes a good night's sleep, and how can I improve mine?",
    "How did the ancient Romans build roads that lasted for centuries?",
    "Suggest a simple recipe for vegetable soup.",
    "Why do leaves change color in autumn?",
]


class TextPrompts:
    """Natural text cut to the token counts a workload draws.

    A request of n tokens is its prompts, in a seeded random order, each prompt in full,
    separated by a blank line, until n tokens are there; the last one is cut. A random
    order per request, rather than the file's order, keeps requests from sharing long
    prefixes that prefix caching would reward (the workloads that want a shared prefix
    build it themselves).
    """

    def __init__(self, prompts: list[str], tokenizer, name: str = "text:builtin"):
        self.name = name
        self.pieces = [tokenizer.encode(p.strip(), add_special_tokens=False) for p in prompts if p.strip()]
        self.pieces = [p for p in self.pieces if p]
        if not self.pieces:
            raise ValueError(f"{name}: no prompt text")
        self.separator = tokenizer.encode("\n\n", add_special_tokens=False)

    @classmethod
    def from_file(cls, path: str, tokenizer) -> "TextPrompts":
        with open(path, encoding="utf-8") as f:
            return cls(f.read().splitlines(), tokenizer, name=f"text:{path}")

    def tokens(self, rng: np.random.Generator, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            for i in rng.permutation(len(self.pieces)):
                if out:
                    out += self.separator
                out += self.pieces[i]
                if len(out) >= n:
                    break
        return out[:n]

    def filler(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.tokens(rng, n)


PromptSource = SyntheticTokens | TextPrompts


def w1_variance(seed: int = 0, num_requests: int = 256, max_num_seqs: int = 32,
                source: PromptSource | None = None) -> Workload:
    """The seeds' thesis: varied output lengths waste static batches."""
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    requests = []
    for _ in range(num_requests):
        out = int(min(512, max(1, round(rng.exponential(64)))))
        requests.append(BenchRequest(source.tokens(rng, int(rng.integers(32, 129))), out))
    return Workload(
        "W1", f"{num_requests} requests at once, prompt 32-128, output capped-exponential mean 64 cap 512, EOS ignored",
        requests, {"max_num_seqs": max_num_seqs}, {"seed": seed, "max_num_seqs": max_num_seqs},
        prompt_source=source.name,
    )


def w2_offline(seed: int = 0, num_requests: int = 128, low: int = 16, high: int = 256, max_num_seqs: int = 32,
               source: PromptSource | None = None) -> Workload:
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    requests = [
        BenchRequest(source.tokens(rng, int(rng.integers(low, high + 1))), int(rng.integers(low, high + 1)), temperature=0.6)
        for _ in range(num_requests)
    ]
    return Workload(
        "W2", f"{num_requests} requests, input and output uniform [{low}, {high}], temperature 0.6, EOS ignored",
        requests, {"max_num_seqs": max_num_seqs}, {"seed": seed, "max_num_seqs": max_num_seqs},
        prompt_source=source.name,
    )


def g3_offline(seed: int = 0, num_requests: int = 256, source: PromptSource | None = None) -> Workload:
    """docs/benchmarks.md's G3: W2 at GPU size, its original definition (input and output uniform
    in [100, 1024]), with 256 requests in flight as vLLM's GPU default allows."""
    workload = w2_offline(seed, num_requests, low=100, high=1024, max_num_seqs=256, source=source)
    return replace(workload, name="G3", description=workload.description + " (W2 at GPU size)")


def g5_variance(seed: int = 0, num_requests: int = 1024, source: PromptSource | None = None) -> Workload:
    """docs/benchmarks.md's G5: W1 at GPU size, 1024 requests at once into 256 seats (W1's 256
    into 32, both scaled by 4 and 8 as G3 scales W2's batch)."""
    workload = w1_variance(seed, num_requests, max_num_seqs=256, source=source)
    return replace(workload, name="G5", description=workload.description + " (W1 at GPU size)")


def w3_online(seed: int = 0, num_requests: int = 64, input_len: int = 128, output_len: int = 128,
              rate_per_s: float = 1.0, source: PromptSource | None = None) -> Workload:
    """Poisson arrivals at `rate_per_s`, fixed input and output lengths (docs/benchmarks.md: 128 / 128).

    The arrival gaps are one seeded draw of unit-rate gaps divided by the rate, drawn apart
    from the prompts: every rate of a sweep sends the same prompts in the same pattern,
    only compressed or stretched in time, so the points of a latency-throughput curve
    differ in load alone. Rate 0 (or inf on the command line) sends all at once.
    """
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    prompts = [source.tokens(rng, input_len) for _ in range(num_requests)]
    gaps = np.random.default_rng([seed, 3]).exponential(1.0, size=num_requests)
    arrivals = np.cumsum(gaps) / rate_per_s if rate_per_s > 0 else np.zeros(num_requests)
    requests = [BenchRequest(p, output_len, arrival_s=float(t)) for p, t in zip(prompts, arrivals)]
    return Workload(
        "W3", f"{num_requests} requests, Poisson arrivals, {input_len} in / {output_len} out, EOS ignored",
        requests, {}, {"seed": seed, "input_len": input_len, "output_len": output_len, "rate_per_s": rate_per_s},
        prompt_source=source.name,
    )


def w4_shared_prefix(seed: int = 0, num_requests: int = 64, prefix_len: int = 256, tail_len: int = 32,
                     output_len: int = 16, rate_per_s: float = 0.0, num_prefixes: int = 1,
                     source: PromptSource | None = None) -> Workload:
    """A shared system prompt: with prefix caching it is computed once. With `num_prefixes`
    above 1, each request takes one of that many system prompts at random (what a
    cache-aware router can keep apart on replicas); 1 draws the same workload as before."""
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    prefixes = [source.tokens(rng, prefix_len)]
    arrivals = _poisson_arrivals(rng, num_requests, rate_per_s)
    prefixes += [source.tokens(np.random.default_rng([seed, 4, k]), prefix_len) for k in range(1, num_prefixes)]
    choice = np.random.default_rng([seed, 5]).integers(num_prefixes, size=num_requests)
    requests = [BenchRequest(prefixes[k] + source.tokens(rng, tail_len), output_len, arrival_s=t)
                for k, t in zip(choice, arrivals)]
    shared = "one" if num_prefixes == 1 else f"{num_prefixes} distinct"
    return Workload(
        "W4", f"{num_requests} requests sharing {shared} {prefix_len}-token prefix(es) with distinct {tail_len}-token tails",
        requests, {}, {"seed": seed, "prefix_len": prefix_len, "tail_len": tail_len, "output_len": output_len,
                       "rate_per_s": rate_per_s, "num_prefixes": num_prefixes},
        prompt_source=source.name,
    )


def w5_priority(seed: int = 0, num_requests: int = 200, high_fraction: float = 0.1, rate_per_s: float = 20.0,
                max_num_seqs: int = 16, source: PromptSource | None = None) -> Workload:
    """A saturating stream of long low-priority requests with a few short high-priority ones."""
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    arrivals = _poisson_arrivals(rng, num_requests, rate_per_s)
    requests = []
    for t in arrivals:
        if rng.random() < high_fraction:
            requests.append(BenchRequest(source.tokens(rng, 32), 16, arrival_s=t, priority=0, label="high"))
        else:
            requests.append(BenchRequest(source.tokens(rng, 128), 128, arrival_s=t, priority=1, label="low"))
    return Workload(
        "W5", f"Poisson {rate_per_s}/s: {1 - high_fraction:.0%} long low-priority (128/128), "
        f"{high_fraction:.0%} short high-priority (32/16)",
        requests, {"max_num_seqs": max_num_seqs},
        {"seed": seed, "high_fraction": high_fraction, "rate_per_s": rate_per_s, "max_num_seqs": max_num_seqs},
        prompt_source=source.name,
    )


def w6_overload(seed: int = 0, num_requests: int = 1000, pool_for: int = 50, prompt_len: int = 32,
                output_len: int = 32, block_size: int = 16, source: PromptSource | None = None) -> Workload:
    """Far more concurrent requests than the KV pool holds: all must complete."""
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    requests = [BenchRequest(source.tokens(rng, prompt_len), output_len) for _ in range(num_requests)]
    blocks_per_request = -(-(prompt_len + output_len) // block_size)
    return Workload(
        "W6", f"{num_requests} concurrent requests ({prompt_len}/{output_len}) on a KV pool for ~{pool_for}",
        requests,
        {"num_kv_blocks": pool_for * blocks_per_request, "max_num_seqs": 256, "max_queue_len": num_requests + 1},
        {"seed": seed, "pool_for": pool_for},
        prompt_source=source.name,
    )


def w7_parallel_sampling(seed: int = 0, num_requests: int = 64, n: int = 4, input_len: int = 128,
                         output_len: int = 64, source: PromptSource | None = None) -> Workload:
    """Parallel sampling: each request samples `n` sequences (temperature 0.8) of one prompt,
    which is prefilled once and whose KV blocks the sequences share."""
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    requests = [BenchRequest(source.tokens(rng, input_len), output_len, temperature=0.8, n=n)
                for _ in range(num_requests)]
    return Workload(
        "W7", f"{num_requests} requests with n={n} at once, {input_len} in / {output_len} out per sequence, "
        "temperature 0.8, EOS ignored",
        requests, {}, {"seed": seed, "n": n, "input_len": input_len, "output_len": output_len},
        prompt_source=source.name,
    )


def w8a_flood(seed: int = 0, num_requests: int = 20, rate_per_s: float = 0.3, in_flight: int = 24,
              long_output: int = 512, chat_output: int = 64, prompt_len: int = 64, max_num_seqs: int = 16,
              source: PromptSource | None = None) -> Workload:
    """Tenant A floods: it keeps `in_flight` long requests (`long_output` tokens) in flight,
    more than the batch has seats. Tenant B sends `num_requests` short chats (`chat_output`
    tokens) as a Poisson stream at `rate_per_s`, meant as a tenth of the engine's capacity
    (rate = capacity in output tokens/s / 10 / chat_output).

    A's flood is under way when B starts: its first `in_flight` requests have 1/in_flight,
    2/in_flight, ... of `long_output` tokens left, so its requests end one after another
    as in a flood running for a while, not all together; each one A sends after them
    (`num_requests` + 4 of them, enough to keep A in flight while B's stream lasts) has
    `long_output` tokens.
    """
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    requests = [BenchRequest(source.tokens(rng, prompt_len), max(1, long_output * (k + 1) // in_flight),
                             label="A", tenant="A") for k in range(in_flight)]
    requests += [BenchRequest(source.tokens(rng, prompt_len), long_output, label="A", tenant="A")
                 for _ in range(num_requests + 4)]
    arrivals = _poisson_arrivals(rng, num_requests, rate_per_s)
    requests += [BenchRequest(source.tokens(rng, prompt_len), chat_output, arrival_s=t, label="B", tenant="B")
                 for t in arrivals]
    return Workload(
        "W8a", f"tenant A keeps {in_flight} requests of {long_output} tokens in flight ({max_num_seqs} seats); "
        f"tenant B: {num_requests} chats of {chat_output} tokens, Poisson {rate_per_s:g}/s; prompts {prompt_len}",
        requests, {"max_num_seqs": max_num_seqs},
        {"seed": seed, "rate_per_s": rate_per_s, "in_flight": in_flight, "long_output": long_output,
         "chat_output": chat_output, "max_num_seqs": max_num_seqs},
        prompt_source=source.name, tenant_concurrency={"A": in_flight},
    )


def w8b_long_job(seed: int = 0, num_requests: int = 60, rate_per_s: float = 4.0, output_len: int = 2000,
                 chat_output: int = 64, num_chat_tenants: int = 4, job_at: float = 10.0, prompt_len: int = 64,
                 max_num_seqs: int = 16, source: PromptSource | None = None) -> Workload:
    """The seeds' case: one long job (`output_len` tokens, tenant "novelist", arriving at
    `job_at` s) among a flood of `num_requests` short chats from `num_chat_tenants` other
    tenants (Poisson at `rate_per_s`, meant to exceed capacity, so a queue builds). All at
    one priority: the question is whether the scheduler's order starves the job."""
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    arrivals = _poisson_arrivals(rng, num_requests, rate_per_s)
    requests = [BenchRequest(source.tokens(rng, prompt_len), chat_output, arrival_s=t, label="chat",
                             tenant=f"chat{i % num_chat_tenants}") for i, t in enumerate(arrivals)]
    requests.append(BenchRequest(source.tokens(rng, prompt_len), output_len, arrival_s=job_at, label="long",
                                 tenant="novelist"))
    return Workload(
        "W8b", f"one {output_len}-token job at {job_at:g} s among {num_requests} chats of {chat_output} tokens "
        f"from {num_chat_tenants} tenants, Poisson {rate_per_s:g}/s ({max_num_seqs} seats); prompts {prompt_len}",
        requests, {"max_num_seqs": max_num_seqs},
        {"seed": seed, "rate_per_s": rate_per_s, "job_output": output_len, "chat_output": chat_output,
         "num_chat_tenants": num_chat_tenants, "job_at_s": job_at, "max_num_seqs": max_num_seqs},
        prompt_source=source.name,
    )


def w10_disaggregated(seed: int = 0, duration_s: float = 90.0, chat_rate_per_s: float = 1.0,
                      long_every_s: float = 15.0, long_input: int = 2000, long_output: int = 16,
                      chat_input: int = 128, chat_output: int = 256, source: PromptSource | None = None) -> Workload:
    """Long prompts (`long_input` in, `long_output` out, label "long") one every `long_every_s`
    seconds, the first half an interval in, among chats (`chat_input` in, `chat_output` out,
    label "chat", Poisson at `chat_rate_per_s`) over `duration_s`: every long prefill lands on
    running decodes, whose inter-token latency it stretches unless prefill runs elsewhere."""
    rng = np.random.default_rng(seed)
    source = source or SyntheticTokens()
    chat_arrivals = [t for t in _poisson_arrivals(rng, int(duration_s * chat_rate_per_s * 2) + 1, chat_rate_per_s)
                     if t < duration_s]
    long_arrivals = np.arange(long_every_s / 2, duration_s, long_every_s).tolist()
    requests = [BenchRequest(source.tokens(rng, chat_input), chat_output, arrival_s=t, label="chat")
                for t in chat_arrivals]
    requests += [BenchRequest(source.tokens(rng, long_input), long_output, arrival_s=t, label="long")
                 for t in long_arrivals]
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(
        "W10", f"{len(long_arrivals)} long prompts ({long_input} in / {long_output} out, one every {long_every_s:g} s) "
        f"among {len(chat_arrivals)} chats ({chat_input} / {chat_output}, Poisson {chat_rate_per_s:g}/s) "
        f"over {duration_s:g} s",
        requests, {},
        {"seed": seed, "duration_s": duration_s, "chat_rate_per_s": chat_rate_per_s, "long_every_s": long_every_s,
         "long_input": long_input, "long_output": long_output, "chat_input": chat_input, "chat_output": chat_output},
        prompt_source=source.name,
    )


def attach_text(workload: Workload, tokenizer, source: PromptSource | None = None, seed: int = 0) -> Workload:
    """Give every request a `prompt_text` that `tokenizer.encode` turns into exactly its ids.

    Decoded ids rarely re-encode to the same ids (neighbours merge into one token, a
    random id decodes to text that splits in two), so the text is re-encoded, cut or
    topped up from `source` (the one the workload was built from), and decoded again
    until its length holds; then the request's ids become that encoding, so the
    in-process engine and a server (which tokenizes the text) get the same tokens.
    Requests already holding text are left alone. Returns the workload, changed in place.
    """
    rng = np.random.default_rng([seed, 7])
    source = source or SyntheticTokens()
    for request in workload.requests:
        if request.prompt_text is not None:
            continue
        target = len(request.prompt_token_ids)
        ids = list(request.prompt_token_ids)
        for _ in range(50):
            # Special tokens are the tokenizer's to add (a BOS), not text to repeat.
            text = tokenizer.decode(ids, skip_special_tokens=True)
            encoded = tokenizer.encode(text)
            if len(encoded) == target:
                break
            ids = encoded[:target] + source.filler(rng, max(0, target - len(encoded)))
        else:
            raise ValueError(f"no text encodes to {target} tokens (after 50 tries)")
        request.prompt_text = text
        request.prompt_token_ids = encoded
    return workload


def _poisson_arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> list[float]:
    if rate_per_s <= 0:
        return [0.0] * n
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=n)).tolist()


WORKLOADS = {
    "W1": w1_variance,
    "W2": w2_offline,
    "G3": g3_offline,
    "G5": g5_variance,
    "W3": w3_online,
    "W4": w4_shared_prefix,
    "W5": w5_priority,
    "W6": w6_overload,
    "W7": w7_parallel_sampling,
    "W8a": w8a_flood,
    "W8b": w8b_long_job,
    "W10": w10_disaggregated,
}
