"""OpenAI-compatible HTTP frontend for the inflight backend, over Triton gRPC streaming.

    .venv/bin/python -m client.openai --triton-url 127.0.0.1:8001 --port 9000
    curl -s localhost:9000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health`` (200 when Triton is live). Each generation is one Triton gRPC stream
(``ModelStreamInfer``) carrying one request with ``stream`` true; the backend's responses
become server-sent events (``stream`` true, ending with ``data: [DONE]``) or are
collected into one JSON body. ``usage`` comes from the backend's ``num_input_tokens`` /
``num_output_tokens`` outputs, ``logprobs`` from its ``logprobs`` output.

Chat prompts are rendered with the checkpoint's chat template (``transformers``
``AutoTokenizer``, local files only, no remote code). The checkpoint is ``--tokenizer``
when given, else the served model's ``model_path`` parameter: absolute, or relative to
``<model repository>/<model>/<version>`` (``--model-repository``; default: this
repository's ``model_repository/``).

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: 400
for a bad request (checked here with the backend's own ``SamplingParams`` table, or
refused by the backend with INVALID_ARG, e.g. a prompt longer than ``max_model_len``),
401 without the API key when ``--api-key`` is set, 404 for an unknown model, 413 for a
body over ``--max-body-bytes``, 503 when the backend is overloaded (UNAVAILABLE: its
waiting queue is full) or Triton cannot be reached, 504 past ``--request-timeout``.

A client that goes away cancels the Triton request (the gRPC stream is cancelled;
the backend sees it within one poll interval and frees the request's KV blocks).

Security defaults: binds 127.0.0.1 unless ``--host`` says otherwise; bodies are bounded;
unknown request fields are refused rather than silently ignored.

Each module imports only those on the lines above its own:

    schema, settings   request models and OpenAI's error JSON; the command line's settings
    tool_calls         a model's own tool-call format: found in its chat template, parsed from its reply
    translation        OpenAI request -> sampling_parameters; backend responses -> OpenAI objects
    upstream           Triton over gRPC: the models it serves, one stream per generation
    app                the FastAPI app: routes, API key, body limits, client disconnects
    cli                the command line (``python -m client.openai``)

This file imports nothing, so importing the schema does not load FastAPI or tritonclient.
"""
