"""Run one serving instance: engine + API under uvicorn, with failure and signal handling.

SIGTERM / SIGINT: the listening socket closes (no new requests), the engine ends requests
still running after ``serve.http.shutdown_timeout_s`` with an error (streams get an error
event), uvicorn waits for the responses to finish, the stages stop, the process exits 0.
When the engine gives up after a stage failure (restarts exhausted or disabled) the
server stops and :func:`serve_forever` raises :class:`~convergent.serve.executor.StageFailure`
(exit code 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

from convergent.serve.config import ServeConfig

__all__ = ["quiet_signals", "serve_forever"]


def quiet_signals() -> None:
    """Make SIGTERM / SIGINT no-ops before uvicorn captures them: after its graceful
    shutdown uvicorn re-raises the captured signal with the previous handler, which by
    default would kill the process (exit -15) instead of letting it exit 0."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


def serve_forever(
    model_dir: Path,
    sc: ServeConfig,
    predictor=None,
    log=lambda msg: print(msg, file=sys.stderr, flush=True),
) -> None:
    """Serve ``model_dir`` on ``serve.http``'s address until SIGTERM / SIGINT, or until the
    engine gives up after a stage failure (then its error is raised)."""
    import uvicorn

    from convergent.serve.api import create_app
    from convergent.serve.engine import Engine
    from convergent.serve.tokenizer import load_tokenizer

    engine = Engine(model_dir, sc)
    tok, note = load_tokenizer(model_dir, engine.vocab_size)
    log(note)
    engine.start()
    try:
        http = sc.http
        app = create_app(engine, http, predictor=predictor, tokenizer=tok)

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                engine.begin_shutdown(http.shutdown_timeout_s)
                super().handle_exit(sig, frame)

        config = uvicorn.Config(
            app,
            host=http.host,
            port=http.port,
            log_level="warning",
            timeout_graceful_shutdown=http.shutdown_timeout_s + 5.0,
        )
        server = _Server(config)

        def fatal(exc: BaseException) -> None:
            log(f"error: {exc}")
            server.should_exit = True

        engine.add_fatal_listener(fatal)
        log(
            f"serving {model_dir} ({sc.scheduler.kind}, {engine.num_stages} stage(s), context "
            f"{engine.context_limit} tokens) on http://{http.host}:{http.port}/v1"
        )
        quiet_signals()
        server.run()
    finally:
        engine.close()
    if engine.error is not None:
        raise engine.error
