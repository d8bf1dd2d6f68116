"""`linearize serve`: the CLI face of the server. Flag names are a contract.

Nothing heavy is imported until the verb runs (torch, transformers, fastapi, uvicorn), so `--help`
stays fast. Every flag is checked before the model loads: a port already taken fails in a second.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys

from ..cli_args import (
    CommandError,
    check_device,
    default_device,
    non_negative_float,
    non_negative_int,
    positive_int,
)

DEFAULTS = {"host": "127.0.0.1", "port": 8000, "max_batch": 8, "max_queue": 64, "max_prompt_tokens": 131072,
            "max_completion_tokens": 4096, "prefill_chunk": 2048, "prefill_budget": 0.0, "prefix_block": 256}


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {text!r}")
    return value


# Decimal units are powers of 1000 (as memory is often quoted: 40GB), binary ones powers of 1024.
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def memory_size(text: str) -> int:
    """Bytes from a size such as 40GB, 40GiB, 512MiB or 1000000 (bytes), > 0; units in any case."""
    number, unit = text.strip(), "b"
    for name in sorted(UNITS, key=len, reverse=True):
        if number.lower().endswith(name):
            number, unit = number[: -len(name)].strip(), name
            break
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 40GB, 40GiB, 512MiB or a number of bytes, "
                                         f"got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a size > 0, got {text!r}")
    return max(1, int(value * UNITS[unit]))


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve one model over OpenAI's completions and chat completions API, "
                                          "many requests at once (docs/serving.md). SIGTERM or Ctrl-C stops taking "
                                          "requests, lets the running ones finish, and exits.")
    p.add_argument("--model", required=True, help="smollm2 or gemma3 (aliases), a .gguf file, a HF folder (a convert "
                   "or distill output) or a hub id")
    p.add_argument("--host", default=DEFAULTS["host"], help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=DEFAULTS["port"], help="TCP port to listen on")
    p.add_argument("--max-batch", type=positive_int, default=DEFAULTS["max_batch"],
                   help="requests generating at once (state slots)")
    p.add_argument("--max-queue", type=non_negative_int, default=DEFAULTS["max_queue"],
                   help="requests that may wait for a slot; past it the server answers 429")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=DEFAULTS["max_prompt_tokens"],
                   help="longest prompt accepted, in tokens (a longer one gets 400)")
    p.add_argument("--max-completion-tokens", type=positive_int, default=DEFAULTS["max_completion_tokens"],
                   help="most tokens a request may ask for (and what a chat request naming none gets)")
    p.add_argument("--prefill-chunk", type=positive_int, default=DEFAULTS["prefill_chunk"],
                   help="prompt tokens prefilled a scheduler turn, between the running requests' steps")
    p.add_argument("--prefill-budget", type=non_negative_float, default=DEFAULTS["prefill_budget"],
                   help="if > 0: while requests generate, a turn's prefill takes about this many times a decode "
                        "step (fewer tokens than --prefill-chunk where it must), so that their tokens keep an even "
                        "pace, at the cost of prompts prefilled a second (0: whole chunks)")
    p.add_argument("--kv-memory", type=memory_size, default=None, metavar="SIZE",
                   help="for a softmax model (the teacher): the most memory its requests' keys and values may take, "
                        "e.g. 40GiB or 40GB: KB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB of 1024 "
                        "(default: 90%% of the GPU memory free at start less --prefix-cache-memory; no limit on a CPU)")
    p.add_argument("--prefix-block", type=positive_int, default=DEFAULTS["prefix_block"], metavar="TOKENS",
                   help="keep the prefilled cache (linearized states, softmax keys and values) at every this many "
                        "prompt tokens that a prefill call ends on, so that a later prompt starting with the same "
                        "tokens prefills only the rest (a prefill call ends on these boundaries)")
    p.add_argument("--prefix-cache-memory", type=memory_size, default=None, metavar="SIZE",
                   help="the most memory the kept prefix snapshots take, least recently used dropped first, sizes as "
                        "--kv-memory's, apart from that budget (default: 1GiB on a GPU, 256MiB on a CPU)")
    p.add_argument("--prefix-cache-host-memory", type=memory_size, default=None, metavar="SIZE",
                   help="host (CPU) memory for the prefix snapshots that --prefix-cache-memory pushes out: they move "
                        "there, least recently used dropped first, and back to the device when a prompt needs one, "
                        "sizes as --kv-memory's (default: none, they are dropped)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="keep no prefix snapshots: every prompt is prefilled whole")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, ... or auto (the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients give as `model` (default: the --model argument as given)")
    p.set_defaults(func=run)
    return p


def check_listen(host: str, port: int) -> None:
    """Refuse an address this machine cannot listen on (unknown host, port taken, no permission) before
    the model loads."""
    if not host.strip():
        raise CommandError("--host is empty: give an address such as 127.0.0.1")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise CommandError(f"--host {host}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise CommandError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def end_tokens(model, tokenizer) -> tuple[int, ...]:
    """The tokens that end a generation: the generation config's (Gemma 3 has two) and the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, tokenizer.eos_token_id):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return tuple(sorted(ids))


def run(args) -> None:
    name = args.model if args.served_model_name is None else args.served_model_name
    if not name.strip():
        raise CommandError("--served-model-name is empty: give the name clients will ask for")
    if args.no_prefix_cache and args.prefix_cache_host_memory is not None:
        raise CommandError("--prefix-cache-host-memory needs the prefix cache: leave out --no-prefix-cache")
    check_device(args.device)
    check_listen(args.host, args.port)

    from ..loading import load_model, load_tokenizer
    from ..modeling import undistilled_note

    model = load_model(args.model, dtype=args.dtype, device=default_device(args.device))
    tokenizer = load_tokenizer(args.model)
    if note := undistilled_note(model.config):
        print(note, file=sys.stderr)

    import uvicorn

    from .app import create_app
    from .engine import Engine

    engine = Engine(model, max_batch=args.max_batch, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                    prefill_budget=args.prefill_budget, eos_token_ids=end_tokens(model, tokenizer),
                    kv_budget_bytes=args.kv_memory, prefix_cache=not args.no_prefix_cache,
                    prefix_block=args.prefix_block, prefix_cache_bytes=args.prefix_cache_memory,
                    prefix_cache_host_bytes=args.prefix_cache_host_memory or 0)
    app = create_app(engine, tokenizer, name, args.max_prompt_tokens, max_completion_tokens=args.max_completion_tokens)
    # h11 and asyncio, not whatever faster parser or loop happens to be installed: the server behaves the
    # same everywhere, and the engine, not the parser, sets the pace. No timeout on the graceful shutdown:
    # it waits for the running requests (a second Ctrl-C forces it).
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="asyncio", http="h11", ws="none",
                            lifespan="on", log_level="info", timeout_graceful_shutdown=None)
    print(f"linearize: serving {name!r} ({engine.stats()['mode']} mode, {args.max_batch} at once, {args.max_queue} waiting) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr)
    engine.start()
    server = _draining_server(uvicorn.Server)(config, app.state.shutdown)
    try:
        server.run()
    except SystemExit:  # uvicorn's way out when it could not start: it has logged why
        raise CommandError(f"the server could not start on {args.host}:{args.port} (see the log above)") from None
    finally:
        if not app.state.engine_stopped:
            engine.stop(drain=False)
    if server.forced_by is not None:
        name = signal.Signals(server.forced_by).name
        _say(f"stopped by a second {name}: the requests in flight were cancelled")
        raise SystemExit(128 + server.forced_by)  # what a process that signal stopped reports


def _draining_server(base):
    """uvicorn's Server, stopping as `linearize serve` promises (docs/serving.md, "Stopping"):

    - the first SIGINT or SIGTERM drains: every new request is answered 503 (the server keeps listening,
      so a client is told rather than refused), the requests in flight finish, then the server exits 0;
    - a second forces: the requests in flight are cancelled and end at once with an error (a stream with
      an error event and `[DONE]`), then the process exits as that signal's default would report it
      (130 for SIGINT, 143 for SIGTERM), with no traceback;
    - a third leaves it to uvicorn's own forced exit, for a client that never reads its answer.

    The signals go to uvicorn's handler, which only counts them; the event loop's tick acts on them."""

    class DrainingServer(base):
        def __init__(self, config, shutdown):
            super().__init__(config)
            self.stopping = shutdown  # not `shutdown`: uvicorn's own method
            self.signals: list[int] = []
            self.forced_by: int | None = None

        def handle_exit(self, sig, frame) -> None:
            # Not uvicorn's: it would close the listening socket at the first signal, and raise the
            # signals again after the shutdown.
            self.signals.append(sig)
            if len(self.signals) >= 3:
                self.should_exit = self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.signals and not self.stopping.draining:
                self.stopping.drain()
                _say(f"draining: {self.stopping.in_flight} request(s) in flight finish, new ones get 503 "
                     "(Ctrl-C again to stop them now)")
            if len(self.signals) >= 2 and not self.stopping.forced:
                self.forced_by = self.signals[1]
                self.stopping.force()
                _say(f"stopping the {self.stopping.in_flight} request(s) in flight")
            if self.stopping.idle:
                return True
            return await super().on_tick(counter)

    return DrainingServer


def _say(message: str) -> None:
    print(f"linearize: {message}", file=sys.stderr, flush=True)
