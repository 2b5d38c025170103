"""The command line: ``python -m client.openai --triton-url HOST:PORT --port 9000``."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from client.openai import __doc__ as package_doc
from client.openai.app import create_app
from client.openai.settings import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MODEL_REPOSITORY,
    DEFAULT_REQUEST_TIMEOUT_S,
    REPO_ROOT,
    Settings,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client.openai", description=package_doc.splitlines()[0])
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton gRPC address (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=9000, help="port to bind (default %(default)s)")
    parser.add_argument("--model-name", action="append", default=[], metavar="NAME",
                        help="serve only this Triton model (repeatable; default: every ready inflight model)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="checkpoint folder with the chat template (default: the model's model_path)")
    parser.add_argument("--model-repository", default=None, metavar="DIR",
                        help="the repository Triton serves, to resolve relative model_path values "
                             f"(default {DEFAULT_MODEL_REPOSITORY.relative_to(REPO_ROOT)}/)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (default %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds one generation may take (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("INFLIGHT_OPENAI_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $INFLIGHT_OPENAI_API_KEY; none)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(
        triton_url=args.triton_url, host=args.host, port=args.port, model_names=args.model_name,
        tokenizer=args.tokenizer, model_repository=args.model_repository, max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout, api_key=args.api_key or None,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5, access_log=args.log_level == "debug")
    return 0
