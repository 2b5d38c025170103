"""The benchmark harness of BENCHMARKS.md: `python -m client.bench W1 ...` (cli.py).

Each module imports only those on the lines above its own:

    workloads, records, flops   the requests to send; what each request did and where it ran
    stats                       a run's metrics and the ratios between systems
    runners, peers, targets     the engine and Hugging Face in-process, the peers, running servers
    systems, overhead           the systems by name; host time per iteration (its own command)
    plot, table                 a report drawn, and tabled for the console and the README
    cli                         the command line

This file imports nothing, so `python -m client.bench.table` and the other commands load
only what they use.
"""
