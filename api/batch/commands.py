"""`loraserve score` and `loraserve evaluate`: their arguments, and each run from file to
output. api.cli dispatches here."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from itertools import chain, islice
from pathlib import Path
from typing import IO

import httpx

from api.batch.by_language import RowLanguages, per_language
from api.batch.evaluation import Judgements, disagreeing_rows, disagreements, evaluate
from api.batch.local import local_service
from api.batch.output import OutputError, Writer, header, open_output, write_json
from api.batch.progress import Progress
from api.batch.remote import remote_service
from api.batch.report import (
    DISAGREEMENTS_SHOWN,
    can_plot,
    draw_plots,
    markdown,
    terminal_table,
)
from api.batch.rows import (
    Columns,
    Format,
    InputError,
    Row,
    count_rows,
    input_identity,
    read_rows,
)
from api.batch.run import Run, Tally, score_file
from api.batch.scoring import Refused, ScoringFailed, Servable, Source, Target
from api.cpus import CpuPinningError, pin_process
from api.models.spec import ModelsFileError, load_models_file
from api.service.core import StartFailed
from api.serving.cascade import CascadeError
from api.serving.unicode import valid_unicode
from api.settings import SettingsError, load_settings

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # as a shell reports a command stopped by Ctrl-C


class UsageError(ValueError):
    """Arguments that do not go together."""


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `score` and `evaluate` subcommands with their arguments."""
    score = commands.add_parser(
        "score",
        help="score a JSONL, CSV or TSV file into JSONL",
        description="Scores every row of FILE with the models file's models (in process, or "
        "against a running server with --url) and writes one JSON line per row, in input "
        "order, after a header line that names the model, adapter, answer identity and input.",
    )
    _common(score)
    score.add_argument("--adapter", help="the adapter (default: the model's default)")
    score.add_argument("-o", "--output", type=Path, help="output JSONL (default: stdout)")
    score.add_argument(
        "--resume",
        action="store_true",
        help="continue the rows --output does not hold yet (an interrupted run of this input)",
    )
    score.set_defaults(run=run_score)

    judge = commands.add_parser(
        "evaluate",
        help="score a labelled file and report metrics per adapter, side by side",
        description="Scores FILE with the model's default adapter and each --adapter (or "
        "the cascade), then reports accuracy, per-label precision/recall/F1, the negative "
        "label's false-positive rate, the confusion matrix, the metrics at the decision "
        "threshold and at the threshold of least cost, and the rows where they disagree.",
    )
    _common(judge)
    judge.add_argument(
        "--adapter",
        action="append",
        default=[],
        help="an adapter to put beside the model's default (repeat for more)",
    )
    judge.add_argument("--label-column", default="label", help="column of the expected label")
    judge.add_argument(
        "--label-map",
        default="",
        help="file labels to the model's, e.g. 0=ham,1=spam or ads=ham,gov=ham",
    )
    judge.add_argument("--cost-fp", type=float, default=1.0, help="cost of a false positive")
    judge.add_argument("--cost-fn", type=float, default=1.0, help="cost of a false negative")
    judge.add_argument(
        "--target-ham-fpr",
        action="append",
        default=[],
        type=fpr_target,
        metavar="RATE",
        help="the highest share of the first label's rows (ham) called the second (spam): "
        "report the decision_threshold that meets it with the best recall (repeat for more)",
    )
    judge.add_argument("--json", type=Path, help="write the metrics as JSON to this file")
    judge.add_argument(
        "--report",
        type=Path,
        help="folder for report.md, plots (with matplotlib) and each servable's scored rows",
    )
    judge.set_defaults(run=run_evaluate)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", help="input .jsonl, .csv or .tsv")
    parser.add_argument(
        "--format", choices=["jsonl", "csv", "tsv"], help="input format (default: from suffix)"
    )
    parser.add_argument(
        "--text-column", default="text", help="column of the text (JSONL: also 'inputs')"
    )
    parser.add_argument(
        "--id-column", default="id", help="column copied to the output as the row's id"
    )
    parser.add_argument(
        "--columns", help="column names of a CSV/TSV without a header row, e.g. label,text"
    )
    parser.add_argument("--model", help="the model (default: the models file's first)")
    parser.add_argument("--cascade", action="store_true", help="the cascade answers")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="texts per request to the batcher (32)"
    )
    parser.add_argument(
        "--truncate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cut texts to the model's length; --no-truncate writes longer ones as errors",
    )
    parser.add_argument(
        "--cache", action=argparse.BooleanOptionalAction, default=True, help="use the caches"
    )
    parser.add_argument(
        "--url", help="score against the server at this URL (API key: API_KEY in the env)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def fpr_target(text: str) -> float:
    """A false-positive rate to meet: a number above 0 and below 1 (0 cannot be told on a
    file, and 1 needs no threshold)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value < 1.0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r}: a rate above 0 and below 1, e.g. 0.01")
    return value


def check_target_fpr(servable: Servable) -> None:
    """--target-ham-fpr's threshold is a `decision_threshold`: a two-label softmax model's."""
    if len(servable.labels) != 2 or servable.multi_label:
        kind = "multi-label" if servable.multi_label else f"{len(servable.labels)} labels"
        raise UsageError(
            f"--target-ham-fpr needs a two-label model, as decision_threshold does: "
            f"{servable.column} is {kind} ({', '.join(servable.labels)})"
        )


def columns_of(args: argparse.Namespace, label: str | None = None) -> Columns:
    names = [n.strip() for n in args.columns.split(",")] if args.columns else None
    return Columns(text=args.text_column, id=args.id_column, label=label, names=names)


def fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"loraserve: {message}", file=sys.stderr)
    return code


def run_command(args: argparse.Namespace) -> int:
    """Runs `score` or `evaluate`; the exit status, with what went wrong on stderr."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.batch_size < 1:
        return fail("--batch-size must be at least 1", EXIT_USAGE)
    if args.cascade and (args.model or args.adapter):
        return fail("--cascade uses each model's default adapter: no --model or --adapter")
    try:
        status: int = asyncio.run(args.run(args))
        return status
    except KeyboardInterrupt:
        print(
            "\nloraserve: interrupted; every line written is whole: --resume continues",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except (
        SettingsError,
        CpuPinningError,
        ModelsFileError,
        CascadeError,
        UsageError,
        InputError,
    ) as exc:
        return fail(str(exc), EXIT_USAGE)
    except (OutputError, StartFailed, ScoringFailed) as exc:
        return fail(str(exc))
    except Refused as exc:
        return fail(f"{exc.code}: {exc.message}")
    except httpx.HTTPError as exc:  # --url: no server there, or the connection broke
        return fail(f"{args.url}: {type(exc).__name__}: {exc}")


def service(args: argparse.Namespace) -> AbstractAsyncContextManager[Source]:
    """The models in this process, or a client of the server at --url."""
    if args.url:
        return remote_service(args.url, os.environ.get("API_KEY"), args.cache)
    return _local(args.cache, args.batch_size)


@asynccontextmanager
async def _local(use_cache: bool, batch_size: int) -> AsyncIterator[Source]:
    from api.models.tokenizing import keep_tokenizers_serial
    from api.observability.logs import quiet_libraries

    settings = load_settings()
    if settings.model_cpus is not None:  # as the service's process holding the models
        pin_process(settings.model_cpus, "MODEL_CPUS")
    quiet_libraries()
    keep_tokenizers_serial()
    specs = load_models_file(settings.models_file, settings.adapter_dirs)
    async with local_service(settings, specs, batch_size, use_cache) as source:
        yield source


def summary(tally: Tally, done_before: int) -> str:
    refused = ", ".join(f"{code}: {n}" for code, n in sorted(tally.errors.items()))
    resumed = f" ({done_before} already in the output)" if done_before else ""
    return (
        f"scored {tally.scored} rows, {tally.refused} written with an error"
        f"{f' ({refused})' if refused else ''}{resumed}"
    )


async def run_score(args: argparse.Namespace) -> int:
    columns = columns_of(args)
    fmt: Format | None = args.format
    total = count_rows(args.file, columns, fmt)
    if args.resume and args.output is None:
        raise UsageError("--resume needs --output: it continues that file")
    target = Target(args.model, args.adapter, args.cascade)
    identity = input_identity(args.file, columns, fmt)
    async with service(args) as source:
        wanted = header(await source.describe(target), args.truncate, identity)
        if args.output is None:
            stream: IO[str] = sys.stdout
            Writer(stream).write([{"header": wanted}])
            done = 0
        else:
            stream, done = open_output(args.output, args.resume, wanted, total)
        try:
            progress = None if args.quiet else Progress(total, done)
            rows = islice(read_rows(args.file, columns, fmt), done, None)
            run = Run(source, target, args.truncate, args.batch_size)
            tally = await score_file(run, rows, Writer(stream), progress)
            if progress is not None:
                progress.finish()
        finally:
            if stream is not sys.stdout:
                stream.close()
    print(f"loraserve: {summary(tally, done)}", file=sys.stderr)
    return 0


def label_map(text: str) -> dict[str, str]:
    """`a=b,c=d` as {a: b, c: d}."""
    pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise UsageError(f"--label-map {text!r}: expected file=model pairs, e.g. 0=ham,1=spam")
    return {k.strip(): v.strip() for k, v in pairs}


async def run_evaluate(args: argparse.Namespace) -> int:
    columns = columns_of(args, args.label_column)
    fmt: Format | None = args.format
    mapping = label_map(args.label_map)
    total = count_rows(args.file, columns, fmt)
    # Only the report's scored files have a header that records the input (a whole read).
    identity = None if args.report is None else input_identity(args.file, columns, fmt)
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)

    def expected(row: Row) -> str | None:
        return None if row.label is None else mapping.get(row.label, row.label)

    targets_fpr = list(dict.fromkeys(args.target_ham_fpr))  # each once, as given
    targets = [Target(args.model), *(Target(args.model, a) for a in args.adapter)]
    if args.cascade:
        targets = [Target(), Target(cascade=True)]
    judged_by: dict[str, Judgements] = {}
    reports = []
    async with service(args) as source:
        for target in targets:
            servable = await source.describe(target)
            if servable.column in judged_by:
                continue  # the default named again
            if targets_fpr:
                check_target_fpr(servable)
            # The predicted label's score is the disagreements' only: kept when they can be.
            judged = Judgements(servable.labels, compared=len(targets) > 1)
            scored = None
            if args.report is not None:
                scored = (args.report / f"scores-{len(judged_by)}.jsonl").open(
                    "w", encoding="utf-8"
                )
            try:
                writer = Writer(scored) if scored is not None else None
                if writer is not None and identity is not None:
                    writer.write([{"header": header(servable, args.truncate, identity)}])
                progress = None if args.quiet else Progress(total)
                # The default adapter asked by its name: a server's canary answers the texts
                # of a request that names none with two adapters, and this judges one.
                asked = target if target.cascade else Target(target.model, servable.adapter)
                run = Run(source, asked, args.truncate, args.batch_size)
                languages = RowLanguages()
                rows = languages.tagged(read_rows(args.file, columns, fmt))
                await score_file(run, rows, writer, progress, expected, judged.add)
                if progress is not None:
                    progress.finish()
            finally:
                if scored is not None:
                    scored.close()
            judged_by[servable.column] = judged
            report = evaluate(servable, judged, args.cost_fp, args.cost_fn, targets_fpr)
            report["per_language"] = per_language(judged, languages)
            reports.append(report)
            labels = servable.labels
    apart = disagreeing_rows(judged_by) if len(judged_by) > 1 else []
    print(terminal_table(reports, len(apart)))
    found = disagreements(judged_by, apart, read_rows(args.file, columns, fmt), expected)
    wanted = args.json is not None or args.report is not None  # else the file is not read again
    shown = list(islice(found, DISAGREEMENTS_SHOWN)) if wanted else []  # the markdown's
    if args.json is not None:
        with args.json.open("w", encoding="utf-8") as stream:
            result = {"input": str(args.file), "servables": reports}
            write_json(stream, result, "disagreements", chain(shown, found))
    if args.report is not None:
        plots = draw_plots(args.report, judged_by, labels)
        text = markdown(reports, shown, len(apart), args.file.name, plots)
        (args.report / "report.md").write_text(valid_unicode(text), encoding="utf-8")
        if not can_plot():
            print("loraserve: no plots: matplotlib is not installed", file=sys.stderr)
    return 0
