"""`flashnext serve` (the OpenAI-compatible server) and `flashnext generate` (one prompt, no server)."""

from __future__ import annotations

import argparse
import errno
import functools
import os
import signal
import sys
import time

import torch

from flashnext.cli.common import DTYPES as _DTYPES
from flashnext.errors import ConfigError, FlashNextError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="checkpoint dir (default: the tiny model, seeded random weights)")
    p.add_argument(
        "--dtype", choices=["auto", *sorted(_DTYPES)], default="auto",
        help="parameter dtype; auto: bfloat16 when the checkpoint's config.json says so, else float32 (default auto)",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ... (default cpu)")
    _add_graph_args(p)
    p.add_argument("--seed", type=int, default=0, help="weight seed of the tiny default model (default 0)")
    p.add_argument("--max-slots", type=int, default=16, help="concurrent sequences (default 16)")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + generation (default 2048)")
    p.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per step (default 512)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--keep-denormals", action="store_true",
        help="keep IEEE denormal floats on the CPU threads (default: flushed to zero, `flashnext.denormals`: "
        "faster prefill, values below 1.2e-38 read as 0)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="a fixed number of draft tokens the model's MTP head proposes per step, verified in one step (0: off; "
        "overrides --speculative); requests may set num_speculative_tokens themselves",
    )
    p.add_argument(
        "--speculative", choices=["auto", "off"], default="auto",
        help="auto (default): with an MTP head, each request drafts as many tokens as its running acceptance and "
        "the measured draft/verify cost make pay, none when nothing pays (serve.spec_auto); off: no drafts",
    )  # fmt: skip
    _add_prefix_cache_args(p)
    _add_ngram_storage_args(p)
    p.add_argument(
        "--ignore-memory-plan", action="store_true",
        help="load even when the memory plan (printed on stderr before loading) says the model cannot fit",
    )  # fmt: skip
    _add_quant_args(p)


def _add_graph_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--decode-graph", choices=["auto", "on", "off"], default="auto",
        help="run decode-only steps as one fixed-shape graph per batch bucket: inductor-compiled on CPU in the "
        "background (minutes per bucket on a few cores; decode steps run eager until their bucket is compiled; "
        "cached on disk, see --compile-cache), a captured CUDA graph on CUDA (seconds, before serving); "
        "auto: on for CUDA, off for CPU (default auto)",
    )  # fmt: skip
    p.add_argument(
        "--compile-cache", default=None, metavar="DIR",
        help="inductor's on-disk cache of compiled decode graphs, reused by the next start (default "
        "$TORCHINDUCTOR_CACHE_DIR if set, else ~/.cache/flashnext/inductor)",
    )  # fmt: skip
    p.add_argument(
        "--decode-buckets", default=None, metavar="N,N,...",
        help="batch sizes decode steps are padded to with --decode-graph (default 1,2,4,8,16,32,64 up to --max-slots)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-lengths", default=None, metavar="N,N,...|none",
        help="CPU with --decode-graph: the piece lengths a batch-1 prompt chunk is compiled in, after the decode "
        "buckets (default 1,2,4,8,16,32,64; none: prefill stays eager)",
    )  # fmt: skip
    p.add_argument(
        "--freeze-weights", action="store_true",
        help="CPU with --decode-graph on: compile the graphs with the weights frozen into them (inductor's freezing "
        "and C++ GEMM template: decode steps of 2+ sequences ~15%% faster, a packed copy of the weights in memory, "
        "longer compiles); weight updates are then refused",
    )  # fmt: skip
    p.add_argument(
        "--decode-run", type=int, default=1, metavar="K",
        help="with --decode-graph on: up to K decode steps per engine step while every running request decodes "
        "greedily with nothing adjusting its logits and none waits (the same tokens; the host's per-step work "
        "paid once per run: 3-5%% more tokens/s at batch 1 and 16 on a 2-core CPU; a run's tokens stream together; "
        "default 1: off)",
    )  # fmt: skip


def _add_prefix_cache_args(p: argparse.ArgumentParser) -> None:
    from flashnext.serve.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET_MB

    p.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false",
        help="prefill every prompt whole (default: reuse the state of prompt prefixes seen before, exactly)",
    )  # fmt: skip
    p.add_argument(
        "--prefix-cache-mb", type=float, default=DEFAULT_BUDGET_MB, metavar="MB",
        help=f"MiB the prefix cache keeps on the model's device (default {DEFAULT_BUDGET_MB:g})",
    )  # fmt: skip
    p.add_argument(
        "--prefix-block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="B",
        help=f"tokens per prefix-cache block, a multiple of 64 and of the QSA block (default {DEFAULT_BLOCK_SIZE})",
    )  # fmt: skip


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    from flashnext.quant.apply import DEFAULT_GROUP, EXPERT_SCHEMES, TRUNK_SCHEMES, WEIGHTS

    p.add_argument(
        "--weights", choices=WEIGHTS, default="bf16",
        help="quantize the loaded model in memory for the CPU: int8 (trunk and experts int8 per output channel), "
        "int4 (experts int4 per group, trunk int8); bf16: as loaded in --dtype (default bf16)",
    )  # fmt: skip
    p.add_argument("--trunk", choices=TRUNK_SCHEMES, default=None, help="override --weights for the dense trunk")
    p.add_argument("--experts", choices=EXPERT_SCHEMES, default=None, help="override --weights for the experts")
    p.add_argument(
        "--int4-group", type=int, default=DEFAULT_GROUP, metavar="G",
        help=f"int4 experts: input features per scale/zero group, 32, 64 or 128 (default {DEFAULT_GROUP})",
    )  # fmt: skip


def _quant_scheme(args: argparse.Namespace):
    from flashnext.quant.apply import QuantScheme

    return QuantScheme.from_flags(args.weights, args.trunk, args.experts, args.int4_group)


def _add_ngram_storage_args(p: argparse.ArgumentParser) -> None:
    from flashnext.ngram import DEFAULT_RESIDENT_MB, STORAGES

    p.add_argument(
        "--ngram-storage", choices=STORAGES, default="auto",
        help="n-gram tables: auto (FP8 stays FP8, else the model dtype), dense (model dtype), stored (as on disk), "
        "mmap (rows read from the checkpoint files on demand), nf4 (4-bit rows, quantised at load) (default auto)",
    )  # fmt: skip
    p.add_argument(
        "--ngram-resident-mb", type=float, default=DEFAULT_RESIDENT_MB, metavar="MB",
        help=f"with --ngram-storage mmap: MiB of rows cached in memory per table (default {DEFAULT_RESIDENT_MB})",
    )  # fmt: skip


def _build_engine(args: argparse.Namespace):
    from flashnext.cli.plan import check_serving_plan
    from flashnext.denormals import flush_denormals
    from flashnext.serve.decode_graph import use_compile_cache
    from flashnext.serve.engine import Engine
    from flashnext.serve.loading import checkpoint_dtype, load_for_serving

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    flush_denormals(not args.keep_denormals)
    device = _device(args.device)
    dtype = _DTYPES[args.dtype] if args.dtype != "auto" else checkpoint_dtype(args.model)
    check_serving_plan(args, dtype, device)  # before anything is loaded: a model that cannot fit stops here
    model, tokenizer, name = load_for_serving(
        args.model, dtype, args.seed, ngram_storage=args.ngram_storage, ngram_resident_mb=args.ngram_resident_mb,
        device=device, quant=_quant_scheme(args),
    )  # fmt: skip
    k = args.speculative_tokens
    if k is None:  # --speculative: auto where the model has a head
        k = "auto" if args.speculative == "auto" and model.mtp is not None else 0
    elif k and model.mtp is None:
        raise ConfigError(
            f"--speculative-tokens {k}: {args.model or 'the model'} has no MTP draft head (no mtp.* weights, or no "
            "mtp_num_hidden_layers in its config.json); serve it without --speculative-tokens"
        )
    graph = args.decode_graph == "on" or (args.decode_graph == "auto" and device.type == "cuda")
    if graph and device.type == "cpu":
        use_compile_cache(args.compile_cache)
    if args.freeze_weights and not (graph and device.type == "cpu"):
        raise ConfigError("--freeze-weights freezes the weights into the CPU decode graph: add --decode-graph on")
    if args.decode_run < 1 or (args.decode_run > 1 and not graph):
        raise ConfigError(f"--decode-run {args.decode_run}: decode runs are steps of the decode graph, K >= 1 with "
                          "--decode-graph on (1: off)")  # fmt: skip
    try:
        engine = Engine(
            model, tokenizer, args.max_slots, args.max_model_len, args.max_batched_tokens, k, decode_graph=graph,
            decode_buckets=_buckets(args.decode_buckets), prefill_lengths=_lengths(args.prefill_lengths),
            prefix_cache=args.prefix_cache, freeze_weights=args.freeze_weights,
            prefix_cache_mb=args.prefix_cache_mb, prefix_block_size=args.prefix_block_size,
            decode_run=args.decode_run,
        )  # fmt: skip
    except ConfigError as e:
        if "num_speculative_tokens" not in str(e):  # e.g. the decode graph's: its message names its flags itself
            raise
        raise ConfigError(f"--speculative-tokens {k}: {e}") from None
    return engine, name


def _device(name: str) -> torch.device:
    """`--device` as a torch device; `FlashNextError` naming it when it is malformed or not available here."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise FlashNextError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlashNextError(f"--device {name}: CUDA is not available (this torch {torch.__version__} sees no GPU)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise FlashNextError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    if device.type not in ("cpu", "cuda"):
        raise FlashNextError(f"--device {name}: serving runs on cpu or cuda")
    return device


def _buckets(text: str | None, flag: str = "--decode-buckets") -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FlashNextError(f"{flag} must be comma-separated ints, got {text!r}") from None


def _lengths(text: str | None) -> list[int] | None:
    return [] if text is not None and text.strip() == "none" else _buckets(text, "--prefill-lengths")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from flashnext.serve.http_limits import DEFAULT_MAX_REQUEST_BYTES

    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* and /inference/*")
    p.add_argument(
        "--admin-key", default=None,
        help="enable the weight-update routes (/admin/weights/*, what `flashnext rl --inference-url` syncs through) "
        "behind `Authorization: Bearer KEY` (default: $FLASHNEXT_ADMIN_KEY if set, else disabled)",
    )  # fmt: skip
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model id clients send and /v1/models lists (default: the --model dir's name, or flashnext-tiny)",
    )
    p.add_argument(
        "--tool-call-parser", default="auto", choices=("auto", "qwen3_coder", "xml", "hermes", "none"),
        help="how chat answers' tool calls are read: the Qwen3-Coder XML dialect (qwen3_coder = xml), Hermes JSON, "
        "none, or auto: the dialect the chat template shows (default auto)",
    )  # fmt: skip
    p.add_argument(
        "--reasoning-parser", default="auto", choices=("auto", "qwen3", "none"),
        help="split think blocks into `reasoning`: qwen3, none, or auto: when the chat template has them (default)",
    )  # fmt: skip
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES} = 8 MiB)",
    )


def _port(text: str) -> int:
    """argparse type of --port: an integer in [0, 65535] (else a one-line usage error naming the value)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {text!r}")
    return port


def _listen_socket(host: str, port: int):
    """A socket bound to host:port (before anything is announced); `FlashNextError` naming them if it cannot be."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise FlashNextError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT at once
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (is another server running there? choose one with --port)" if e.errno == errno.EADDRINUSE else ""
        raise FlashNextError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def _serve_app(args: argparse.Namespace):
    """(FastAPI app, served model name, engine) for `flashnext serve`'s arguments."""
    from flashnext.serve.server import build_app

    if args.max_request_bytes < 1:
        raise FlashNextError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    engine, name = _build_engine(args)
    name = args.served_model_name or name
    admin_key = args.admin_key if args.admin_key is not None else os.environ.get("FLASHNEXT_ADMIN_KEY") or None
    app = build_app(
        engine, name, args.api_key, model_dir=args.model, max_request_bytes=args.max_request_bytes, admin_key=admin_key,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
    )
    return app, name, engine


def run_serve(args: argparse.Namespace) -> None:
    import logging

    import uvicorn

    sock = _listen_socket(args.host, args.port)  # a port in use fails here, before any "serving" line
    engine = None
    try:
        app, name, engine = _serve_app(args)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        port = sock.getsockname()[1]  # the one bound (--port 0: a free one)
        server = _server_class()(uvicorn.Config(app, log_level="warning"))
        if engine.decode_graph is not None:
            server.after_startup = _prepare_decode_graph(engine.decode_graph, engine.chunk_graph)
        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        print(
            f"serving {name!r} on http://{args.host}:{port}/v1 (max_slots={engine.cache.max_slots}, {dtype} on "
            f"{engine.device})",
            flush=True,
        )
        server.run(sockets=[sock])
        if server.first_signal == signal.SIGINT:  # see `_server_class`: re-raised, yet it may not come back
            raise KeyboardInterrupt
        _exit_if_compiling(0, engine.decode_graph, engine.chunk_graph)
    except KeyboardInterrupt:  # Ctrl-C (uvicorn raises it again once it has shut down): one line, not a traceback
        print("flashnext serve: stopped by SIGINT", file=sys.stderr, flush=True)
        _exit_if_compiling(130, *((engine.decode_graph, engine.chunk_graph) if engine else ()))
        raise SystemExit(130) from None
    finally:
        sock.close()


def _prepare_decode_graph(graph, chunks):
    """CUDA: capture every bucket now (seconds). CPU: return what starts compiling them in the background (minutes
    each), then the prefill chunk lengths (`chunks`), which the server calls once it listens (so the compile does not
    slow its start): the server is ready at once, and steps run eager until their graph is compiled (logged as each
    switches)."""
    if graph.cuda:
        print(f"capturing the decode step for batch buckets {graph.buckets} ...", flush=True)
        took = graph.warmup()
        print("decode step ready: " + ", ".join(f"{b}: {t:.1f}s" for b, t in took.items()), flush=True)
        return None
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    print(
        f"compiling the decode step for batch buckets {graph.buckets}"
        + (f", then the prefill step for chunk lengths {chunks.buckets}," if chunks is not None else "")
        + f" in the background (cache {cache}); steps run eager until their graph is compiled",
        flush=True,
    )
    return functools.partial(graph.compile_in_background, then=chunks and chunks.compile_in_background)


def _exit_if_compiling(code: int, *graphs) -> None:
    """Exit at once with `code` while a decode- or prefill-graph compile still runs in its daemon thread: it cannot
    be stopped, and finalising the interpreter around it aborts the process (SIGABRT from torch's C++ side,
    measured). The compile is lost; nothing else is pending (the requests were ended, output is flushed)."""
    if any(g is not None and g.background is not None and g.background.is_alive() for g in graphs):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose first SIGINT/SIGTERM also ends every request in flight (their clients get the
        503 `aborted` error body, or an error event on a stream), so shutting down never waits for long
        generations; a second signal is uvicorn's own forced exit. `after_startup`, if set, is called once it
        listens. `first_signal`: the signal that stopped it. Once shut down, uvicorn raises a captured SIGINT again
        from inside the event loop, where asyncio's runner has its own SIGINT handler (it cancels the main task);
        the KeyboardInterrupt did not always come out of `run` (both SIGINT cases of one CI run exited 0, likely the
        task finishing as it was cancelled), so `run_serve` raises it itself."""

        after_startup = None
        first_signal = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.after_startup is not None and not self.should_exit:
                self.after_startup()

        def handle_exit(self, sig, frame) -> None:
            self.first_signal = self.first_signal or sig
            loop = self.config.app.state.routes.loop
            if not self.should_exit and loop is not None:
                busy = len(loop.engine.running) + len(loop.engine.waiting)
                name = signal.Signals(sig).name
                msg = f"flashnext serve: {name}: shutting down, cancelling {busy} request(s) in flight"
                print(msg, file=sys.stderr, flush=True)
                loop.stop()
            super().handle_exit(sig, frame)

    return Server



def _add_generate_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--prompt", default="Hello", help="prompt text (default 'Hello')")
    p.add_argument("--ids", default=None, help="comma-separated prompt token ids instead of --prompt")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message (chat template); stop at <|im_end|>"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="seed of the sampler")


def run_generate(args: argparse.Namespace) -> None:
    from flashnext.serve.loading import end_of_turn_ids
    from flashnext.serve.sampling import SamplingParams

    engine, _ = _build_engine(args)
    tok = engine.tokenizer
    stop_ids = []
    if args.ids is not None:
        try:
            prompt = [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise FlashNextError(f"--ids must be comma-separated ints, got {args.ids!r}") from None
    elif args.chat:
        if tok is None:
            raise FlashNextError("--chat needs a tokenizer in the checkpoint")
        prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        stop_ids = end_of_turn_ids(tok)  # the assistant's turn ends there, as on the server's chat endpoint
    else:
        prompt = args.prompt
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sample_seed, stop_token_ids=stop_ids,
    )  # fmt: skip
    start = time.perf_counter()
    graph = _generate_graph(engine)
    out = engine.generate([prompt], params)[0]
    seconds = time.perf_counter() - start
    print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    spec = ""
    if out.num_verify_steps:
        spec = f", drafts accepted {out.num_accepted_tokens}/{out.num_draft_tokens} in {out.num_verify_steps} steps"
    print(
        f"# {len(out.token_ids)} tokens in {seconds:.2f}s, finish_reason={out.finish_reason}{spec}, "
        f"ids={out.token_ids}",
        file=sys.stderr,
    )
    if graph is not None:
        _finish_graph(graph, start)


def _generate_graph(engine):
    """`generate --decode-graph` on CPU: compile the one bucket a single prompt decodes in (batch 1) in the
    background and start generating eagerly at once; the decode steps switch to the graph when it is ready (a line
    says so). CUDA: capture it now (seconds). Returns the graph still compiling, if any."""
    graph = engine.decode_graph
    if graph is None:
        return None
    N = graph.bucket(1)
    if graph.cuda:
        graph.warmup([N])
        return None
    start = time.perf_counter()
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    print(f"# decode graph: compiling batch bucket {N} in the background (cache {cache}); decoding eagerly until it "
          "is ready", file=sys.stderr, flush=True)  # fmt: skip

    def ready(bucket: int, took: float) -> None:
        at = time.perf_counter() - start
        print(f"# decode graph: bucket {bucket} compiled in {took:.1f} s; decode steps run it from {at:.1f} s on",
              file=sys.stderr, flush=True)  # fmt: skip

    graph.compile_in_background([N], on_ready=ready)
    return graph


def _finish_graph(graph, start: float) -> None:
    """Wait for a compile still running after the generation, so that the next run finds it in the compile cache,
    with a progress line every 15 s; Ctrl-C leaves it (one line, exit 130)."""
    if not graph.background.is_alive():
        return
    try:
        while not _join(graph.background, 15.0):
            took = time.perf_counter() - start
            print(f"# decode graph: still compiling ... {took:.0f} s (for the compile cache; Ctrl-C skips)",
                  file=sys.stderr, flush=True)  # fmt: skip
    except KeyboardInterrupt:
        print("flashnext generate: decode graph compile skipped (SIGINT)", file=sys.stderr, flush=True)
        _exit_if_compiling(130, graph)
        raise SystemExit(130) from None


def _join(thread, timeout: float) -> bool:
    thread.join(timeout)
    return not thread.is_alive()
