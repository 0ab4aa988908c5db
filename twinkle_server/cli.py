"""`twinkle-server`: serve, manage API keys, and inspect runs."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from twinkle_server.config import flags
from twinkle_server.engine.errors import EngineError
from twinkle_server.store import Store
from twinkle_server.store.database import DB_FILE
from twinkle_server.store.keys import check_tenant
from twinkle_server.store.lock import holder, keys_settled
from twinkle_wire import paths


def _data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path,
                        default=Path(os.environ.get("TWINKLE_DATA_DIR", "./twinkle-data")),
                        help="SQLite store and checkpoint files (env TWINKLE_DATA_DIR)")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def cmd_serve(args: argparse.Namespace) -> int:
    from twinkle_server.engine import hub
    from twinkle_server.ranks import launch
    from twinkle_server.server import ConfigError, GroupLost, config_problem, own_data_dir, serve

    try:
        cfg = flags.from_args(args)
    except EngineError as exc:   # a TWINKLE_* value its flag would refuse
        print(f"twinkle-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not launch.under_launcher():
        try:
            # Checked before a download, a launch or a load; the ranks of a launch check
            # the rest (`config_problem` on their world) once they run.
            problem = cfg.problem() if launch.wants_launch(cfg) else config_problem(cfg)
            if problem is not None:
                raise ConfigError(problem)
            # Hub ids are fetched here, once a node, before any rank loads from the cache.
            for model in cfg.model_configs():
                hub.fetch(model.path, cfg.offline == "on")
            if launch.wants_launch(cfg):
                return launch.launch(cfg, args.argv)
            asyncio.run(serve(cfg))
        except (ConfigError, EngineError) as exc:
            print(f"twinkle-server: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            return _cannot_serve(exc)
        return 0
    # One rank of several: rank 0 checks the configuration for all, so a bad one ends
    # every rank at once instead of leaving the others waiting in a collective.
    try:
        parallel, channel = launch.join(cfg)
    except EngineError as exc:
        print(f"twinkle-server: {exc}", file=sys.stderr)
        return 2
    clean = True
    lock = None
    try:
        problem = None
        if parallel.rank == 0:   # it alone owns the data dir; refused, no rank loads
            try:
                lock = own_data_dir(cfg)
                problem = config_problem(cfg, parallel.world)
            except ConfigError as exc:
                problem = str(exc)
        problem = channel.agree(problem)
        if problem is not None:
            if parallel.rank == 0:
                print(f"twinkle-server: {problem}", file=sys.stderr)
            return 2
        if parallel.rank != 0:
            code = launch.run_follower(cfg, parallel, channel)
            clean = code != 1
            return code
        asyncio.run(serve(cfg, parallel=parallel, channel=channel, lock=lock))
    except (ConfigError, EngineError) as exc:
        print(f"twinkle-server: {exc}", file=sys.stderr)
        return 2
    except GroupLost as exc:
        clean = False
        print(f"twinkle-server: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        return _cannot_serve(exc)
    finally:
        parallel.close(clean)
    return 0


def _no_registry(data_dir: Path) -> bool:
    """True, having said so, when `data_dir` holds no registry: a command that only reads
    or changes what is there never makes one (a mistyped --data-dir is not an empty one)."""
    if (Path(data_dir) / DB_FILE).is_file():
        return False
    print(f"twinkle-server: --data-dir {data_dir}: no Twinkle data dir there (no {DB_FILE}); "
          "give the one the server was started with", file=sys.stderr)
    return True


def _cannot_serve(exc: OSError) -> int:
    """An error of the machine (a file the server cannot read or write, a device gone):
    one line, exit 2; `--log-level debug` logs where it came from. A port taken after
    `config_problem` checked it is `serve`'s ConfigError; any other exception is a bug,
    and its traceback is printed."""
    logging.getLogger("twinkle_server").debug("serve failed", exc_info=exc)
    print(f"twinkle-server: {exc}", file=sys.stderr)
    return 2


def cmd_keys(args: argparse.Namespace) -> int:
    if args.action != "create" and _no_registry(args.data_dir):
        return 2
    if args.action == "create":
        with keys_settled(args.data_dir):
            held = holder(args.data_dir)
            if held is not None and held.open_mode:
                # It decided at its start that it is open, and would stay so beside the
                # key, keeping every client's work as tenant 'local'.
                print(f"twinkle-server: the server on {args.data_dir} (pid {held.pid or '?'}) "
                      "runs open, with no API keys, and would stay open: stop it, create "
                      "the key, then start it again", file=sys.stderr)
                return 2
            try:
                key_id, key = Store(args.data_dir).create_key(args.tenant)
            except ValueError as exc:
                print(f"twinkle-server: --{exc}", file=sys.stderr)
                return 2
        print(f"created key {key_id} for tenant {args.tenant}; it is shown only this once:")
        print(key)
    elif args.action == "list":
        rows = [[k.key_id, k.tenant, _when(k.created_at), _when(k.revoked_at)]
                for k in Store(args.data_dir).list_keys()]
        print(_table(["KEY ID", "TENANT", "CREATED", "REVOKED"], rows))
    else:
        if not Store(args.data_dir).revoke_key(args.key_id):
            print(f"no active key {args.key_id!r}", file=sys.stderr)
            return 1
        print(f"revoked key {args.key_id}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    if _no_registry(args.data_dir):
        return 2
    store = Store(args.data_dir)
    if args.action == "list":
        runs, total = store.list_runs(args.tenant, args.limit, 0)
        rows = [[r.run_id, r.tenant, r.base_model, str(r.lora["rank"]), _when(r.created_at),
                 _when(r.last_request_time)] for r in runs]
        print(_table(["RUN", "TENANT", "BASE MODEL", "RANK", "CREATED", "LAST REQUEST"], rows))
        print(f"{len(runs)} of {total} runs")
        return 0
    run = next((r for r in store.list_runs(None, 1_000_000, 0)[0] if r.run_id == args.run_id),
               None)
    if run is None:
        print(f"no run {args.run_id!r}", file=sys.stderr)
        return 1
    checkpoints, _ = store.list_checkpoints(run.tenant, run.run_id)
    if args.action == "show":
        for label, value in (("run", run.run_id), ("tenant", run.tenant),
                             ("base model", run.base_model), ("lora", str(run.lora)),
                             ("metadata", str(run.user_metadata)),
                             ("created", _when(run.created_at)),
                             ("last request", _when(run.last_request_time)),
                             ("checkpoints", str(len(checkpoints)))):
            print(f"{label:<14}{value}")
        return 0
    rows = [[f"twinkle://{c.run_id}/{c.checkpoint_id}", c.kind, str(c.size_bytes),
             "yes" if c.has_optimizer else "no", _when(c.created_at)] for c in checkpoints]
    print(_table(["PATH", "TYPE", "BYTES", "OPTIMIZER", "CREATED"], rows))
    return 0


def cmd_adapters(args: argparse.Namespace) -> int:
    """`adapters import DIR --tenant T`: a PEFT adapter on disk, checked against the base
    it was trained on, as an external_weights checkpoint of the tenant's; beside a running
    server or without one, as `keys create` is. The served models and limits come from
    the data dir (`config.served`: what its server loaded) unless `--model`, `--models`
    or `--max-rank` name them; among several, `--base-model` or the adapter's own
    `base_model_name_or_path` picks."""
    from twinkle_server.config.served import pick, read_served
    from twinkle_server.engine.adapter_import import base_linears, named_base, read_import
    from twinkle_server.engine.base_model import model_dir
    from twinkle_server.runtime.imports import MAX_UPLOAD_BYTES, register

    directory = Path(args.directory)
    try:
        check_tenant(args.tenant)   # the store refuses it too; say so before any work
    except ValueError as exc:
        print(f"twinkle-server: --{exc}", file=sys.stderr)
        return 2
    try:
        served = None
        if not (args.model or args.models or args.max_rank):
            served = read_served(Path(args.data_dir))
        if served is None:
            models = flags.ServerConfig(
                model=args.model or "", models=Path(args.models) if args.models else None,
                max_rank=args.max_rank or flags.ServerConfig.max_rank).model_configs()
            served = [(m, model_dir(m.path)) for m in models]
        model, base_dir = pick(served, args.base_model, named_base(directory))
        adapter = read_import(directory, base_linears(base_dir), model.max_rank,
                              MAX_UPLOAD_BYTES)
        row = register(Store(args.data_dir), args.tenant, model.name,
                       model.tokenizer_id(base_dir), adapter, f"directory {args.directory}")
    except EngineError as exc:
        print(f"twinkle-server: {exc}", file=sys.stderr)
        return 2
    print(paths.tinker_path(row.run_id, row.checkpoint_id))
    return 0


def cmd_sessions(args: argparse.Namespace) -> int:
    """`sessions trace ID`: a session's trace from the data dir's running server, through
    a URL signed with the data dir's own secret (reading the data dir is the operator's
    grant, as for every command here): Chrome trace-event JSON, for ui.perfetto.dev."""
    import httpx

    from twinkle_server.config.served import served_front
    from twinkle_server.runtime.signed_urls import Signer, load_secret
    from twinkle_server.runtime.trace_exports import operator_path

    data_dir = Path(args.data_dir)
    if _no_registry(data_dir):
        return 2
    try:
        front = served_front(data_dir)
    except EngineError as exc:
        print(f"twinkle-server: {exc}", file=sys.stderr)
        return 2
    if front is None:
        print(f"twinkle-server: no server with an HTTP front has run on {data_dir} (start it "
              "with --http-port; 0 picks a free port)", file=sys.stderr)
        return 2
    signed = Signer(load_secret(data_dir)).sign(operator_path(args.session_id), 60)
    try:
        answer = httpx.get(front.url + signed.url, timeout=60, verify=args.ca or True)
    except httpx.HTTPError as exc:
        print(f"twinkle-server: the server at {front.url} did not answer ({exc}); is it "
              "still running?", file=sys.stderr)
        return 1
    if answer.status_code != 200:
        print(f"twinkle-server: {answer.json().get('detail', answer.text)}", file=sys.stderr)
        return 1
    out = Path(args.output or f"{args.session_id}.json")
    out.write_bytes(answer.content)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinkle-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gRPC training server")
    flags.add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", help="create, list or revoke API keys")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    create = keys_sub.add_parser("create", help="create a key for a tenant (printed once)")
    create.add_argument("--tenant", required=True)
    keys_sub.add_parser("list", help="list keys (never their values)")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    for p in (create, *keys_sub.choices.values()):
        if not any(a.dest == "data_dir" for a in p._actions):
            _data_dir(p)
    keys.set_defaults(func=cmd_keys)

    runs = sub.add_parser("runs", help="inspect training runs and checkpoints")
    runs_sub = runs.add_subparsers(dest="action", required=True)
    listing = runs_sub.add_parser("list", help="every run, newest first")
    listing.add_argument("--tenant", default=None)
    listing.add_argument("--limit", type=int, default=50)
    for name in ("show", "checkpoints"):
        p = runs_sub.add_parser(name, help=f"{name} of one run")
        p.add_argument("run_id")
    for p in runs_sub.choices.values():
        _data_dir(p)
    runs.set_defaults(func=cmd_runs)

    adapters = sub.add_parser("adapters", help="import adapters trained elsewhere")
    adapters_sub = adapters.add_subparsers(dest="action", required=True)
    imported = adapters_sub.add_parser(
        "import", help="a PEFT LoRA directory (adapter_config.json, "
                       "adapter_model.safetensors) as a tenant's checkpoint; prints its path")
    imported.add_argument("directory")
    imported.add_argument("--tenant", required=True)
    imported.add_argument("--base-model", default="",
                          help="the served model it was trained on (default: the one its "
                               "adapter_config.json names, or the only one served)")
    imported.add_argument("--model", default=os.environ.get("TWINKLE_MODEL"),
                          help="the server's --model (env TWINKLE_MODEL; default: what the "
                               "data dir's server serves, else tiny)")
    imported.add_argument("--models", default=os.environ.get("TWINKLE_MODELS"),
                          help="the server's --models file (env TWINKLE_MODELS; default: "
                               "what the data dir's server serves)")
    # A string default is converted (and refused, by argparse) only when this command runs.
    imported.add_argument("--max-rank", type=int, default=os.environ.get("TWINKLE_MAX_RANK"),
                          help="the server's --max-rank (env TWINKLE_MAX_RANK; default: the "
                               "data dir's server's, else 128)")
    _data_dir(imported)
    adapters.set_defaults(func=cmd_adapters)

    sessions = sub.add_parser("sessions", help="inspect the running server's sessions")
    sessions_sub = sessions.add_subparsers(dest="action", required=True)
    trace = sessions_sub.add_parser(
        "trace", help="a session's trace (Chrome trace-event JSON: open it in "
                      "ui.perfetto.dev) from the data dir's running server")
    trace.add_argument("session_id")
    trace.add_argument("-o", "--output", default=None, help="file (default: ID.json)")
    trace.add_argument("--ca", default=None,
                       help="PEM of the CA that signed the server's --tls-cert")
    _data_dir(trace)
    sessions.set_defaults(func=cmd_sessions)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except ValueError as exc:   # a value the store refuses, e.g. a tenant's name
        if args.func is cmd_serve:
            raise
        print(f"twinkle-server: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
