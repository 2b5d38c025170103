"""The benchmark harness of docs/benchmarks.md: `python -m client.bench W1 ...` (cli.py).

Each module imports only those on the lines above its own:

    vllm_peer                   what the vLLM peers share with the harness; standard library only
    workloads, records, flops   the requests to send; what each request did and where it ran
    stats                       a run's metrics and the ratios between systems
    runners, peers, targets     the engine and Hugging Face in-process, the peers, running servers
    systems, overhead           the systems by name; host time per iteration (its own command)
    plot, table                 a report drawn, and tabled for the console and docs/results.md
    cli                         the command line
    loadtest                    perf_analyzer and genai-perf against a server (`make perf`, `make genai-perf`)
    cluster                     the cluster benchmarks, on replicas behind the routers (tools/scaleout.py)
    vllm_offline, vllm_server   vLLM's offline and online peers, run in .venv-peers (`make peers`)
    vllm_backend_peer           Triton's own vLLM backend in tritonserver, run in .venv-vllm-backend

scripts/ holds the shell scripts of a session on a GPU or an AMX machine.

This file imports nothing, so `python -m client.bench.table` and the other commands load
only what they use, and the vLLM peers, which run in .venv-peers on vLLM's own packages,
import nothing of the project's but vllm_peer.
"""
