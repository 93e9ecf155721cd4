"""evaluate's reports: a table for the terminal, markdown for people (with plots where
matplotlib is installed), JSON for machines."""

from __future__ import annotations

import importlib.util
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from api.batch.evaluation import Judgements, precision_recall_curve

Report = dict[str, Any]
DISAGREEMENTS_SHOWN = 20
HISTOGRAM_BINS = 20


def pct(value: float) -> str:
    return f"{100 * value:.2f} %"


def metric_rows(reports: Sequence[Report]) -> list[tuple[str, list[str]]]:
    """(metric, value per servable) in reading order."""
    rows: list[tuple[str, list[str]]] = []

    def add(name: str, values: list[str]) -> None:
        rows.append((name, values))

    for key in ("rows", "scored", "errors", "unlabelled"):
        add(key, [str(r[key]) for r in reports])
    add("accuracy", [pct(r["accuracy"]) for r in reports])
    for label in reports[0]["per_label"]:
        for key in ("precision", "recall", "f1"):
            add(f"{label} {key}", [f"{r['per_label'][label][key]:.4f}" for r in reports])
    negative = reports[0]["negative_label"]
    add(
        f"{negative} false-positive rate", [pct(r["negative_false_positive_rate"]) for r in reports]
    )
    for expected in reports[0]["confusion"]:
        for predicted in reports[0]["confusion"][expected]:
            add(
                f"{expected} → {predicted}",
                [str(r["confusion"][expected][predicted]) for r in reports],
            )
    if all("thresholds" in r for r in reports):
        for name, key in (("decision threshold", "decision"), ("least cost", "least_cost")):
            add(
                f"{name}: served / model",
                [
                    f"{r['thresholds'][key]['served_threshold']:g} / "
                    f"{r['thresholds'][key]['model_threshold']:g}"
                    for r in reports
                ],
            )
            for metric in ("accuracy", "precision", "recall", "false_positive_rate"):
                add(f"  {metric}", [pct(r["thresholds"][key][metric]) for r in reports])
            add("  cost", [f"{r['thresholds'][key]['cost']:g}" for r in reports])
        rows += target_fpr_rows(reports)
    rows += language_rows(reports)
    return rows


def language_rows(reports: Sequence[Report]) -> list[tuple[str, list[str]]]:
    """Per detected language (the first servable's most frequent first): rows and errors,
    accuracy, and with two labels the second label's recall and the first's FPR."""
    if not all("per_language" in r for r in reports):
        return []
    rows: list[tuple[str, list[str]]] = []
    for language in reports[0]["per_language"]:
        found = [r["per_language"].get(language) for r in reports]
        rows.append(
            (
                f"language {language}: rows / errors",
                [f"{f['rows']} / {f['errors']}" if f else "-" for f in found],
            )
        )
        for key, value in (found[0] or {}).items():
            if isinstance(value, float):
                rows.append((f"  {key}", [pct(f[key]) if f else "-" for f in found]))
    return rows


def pct_in_full(value: float) -> str:
    """A target rate in full: 0.001 as 0.1 %, where pct would round 0.00001 to 0.00 %."""
    return f"{100 * value:g} %"


def target_fpr_rows(reports: Sequence[Report]) -> list[tuple[str, list[str]]]:
    """Per --target-ham-fpr, the models file's threshold meeting it (or none, and why), and
    the metrics there."""
    if not all("target_ham_fpr" in r["thresholds"] for r in reports):
        return []
    negative, positive = reports[0]["negative_label"], reports[0]["thresholds"]["positive_label"]
    rows: list[tuple[str, list[str]]] = []
    for index, first in enumerate(reports[0]["thresholds"]["target_ham_fpr"]):
        found = [r["thresholds"]["target_ham_fpr"][index] for r in reports]
        rows.append(
            (
                f"{negative} FPR ≤ {pct_in_full(first['target'])}: decision_threshold",
                [
                    f"none: {f['reason']}" if f["model_threshold"] is None else threshold(f)
                    for f in found
                ],
            )
        )
        for metric in ("recall", "precision", "false_positive_rate"):
            rows.append((f"  {metric}", [pct(f[metric]) if metric in f else "" for f in found]))
        rows.append(
            (
                f"  {negative} → {positive}",
                [f"{f['fp']} of {f['negatives']}" if "fp" in f else "" for f in found],
            )
        )
    return rows


def threshold(found: dict[str, Any]) -> str:
    """The threshold as written in the models file: every digit it was chosen with (repr),
    so that the file makes the cut reported."""
    return repr(found["model_threshold"])


def terminal_table(reports: Sequence[Report], disagreeing: int) -> str:
    """The metrics side by side, one column per servable, in plain text."""
    header = ["", *(r["servable"] for r in reports)]
    body = [[name, *values] for name, values in metric_rows(reports)]
    if len(reports) > 1:
        body.append(["rows where they disagree", str(disagreeing), *[""] * (len(reports) - 1)])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in [header, *body]
    )


def markdown(
    reports: Sequence[Report],
    disagreeing: Sequence[dict[str, Any]],
    disagreeing_count: int,
    source: str,
    plots: Sequence[str],
) -> str:
    """The markdown report: the table, what the thresholds mean, the first DISAGREEMENTS_SHOWN
    of the `disagreeing_count` disagreements (`disagreeing`), plots."""
    names = [r["servable"] for r in reports]
    lines = [
        f"# Evaluation of {', '.join(names)}",
        "",
        f"Input: `{source}`.",
        "",
        "| Metric | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    lines += [f"| {name} | " + " | ".join(values) + " |" for name, values in metric_rows(reports)]
    first = reports[0]
    if "thresholds" in first:
        t = first["thresholds"]
        lines += [
            "",
            f"A text is `{t['positive_label']}` when its served score for that label is above "
            "the served threshold; the served scores are centred on the model's "
            "`decision_threshold`, so 0.5 served is that threshold. The model threshold is "
            "the same threshold on the model's own probabilities: the value `decision_threshold` "
            "in the models file would take. Least cost: the threshold that minimises "
            f"{t['cost_fp']:g} × false positives + {t['cost_fn']:g} × false negatives on "
            "these rows (ties go to the one nearest 0.5); chosen on the rows it is scored on, "
            "it is an optimistic figure.",
        ]
        if "target_ham_fpr" in t:
            lines += ["", *target_fpr_text(reports)]
    if len(reports) > 1:
        lines += ["", f"## Rows where they disagree ({disagreeing_count})", ""]
        if disagreeing:
            lines += [
                "| Row | Id | Expected | " + " | ".join(names) + " |",
                "|---|---|---|" + "---|" * len(names),
            ]
            for d in disagreeing[:DISAGREEMENTS_SHOWN]:
                cells = [f"{d['labels'][n]} ({d['top_scores'][n]:.3f})" for n in names]
                lines.append(
                    f"| {d['row']} | {d['id'] if d['id'] is not None else ''} "
                    f"| {d['expected'] or ''} | " + " | ".join(cells) + " |"
                )
            if (more := disagreeing_count - DISAGREEMENTS_SHOWN) > 0:
                lines.append(f"\n{more} more in the JSON report.")
    lines += ["", "## Plots", ""]
    if plots:
        lines += [f"![{Path(p).stem}]({p})" for p in plots]
    else:
        lines.append("No plots: matplotlib is not installed (`pip install 'loraserve[report]'`).")
    return "\n".join(lines) + "\n"


def target_fpr_text(reports: Sequence[Report]) -> list[str]:
    """What the --target-ham-fpr rows mean, and each threshold as the models file takes it."""
    negative = reports[0]["negative_label"]
    positive = reports[0]["thresholds"]["positive_label"]
    lines = [
        f"{negative} FPR ≤ target (`--target-ham-fpr`): the lowest threshold at which at most "
        f"that share of the `{negative}` rows scores above it, so the best `{positive}` "
        "recall at that rate. "
        "It is on the model's own probabilities: the `decision_threshold` to write in the "
        "models file, strictly between two scores of these rows, with as many digits as keep "
        f"it there. With fewer `{negative}` rows than one false positive needs, none is "
        "given: the file cannot tell the target from 0. Chosen on the rows it is scored on, "
        "it is an optimistic figure.",
        "",
    ]
    for report in reports:
        for found in report["thresholds"]["target_ham_fpr"]:
            head = f"- `{report['servable']}`, {negative} FPR ≤ {pct_in_full(found['target'])}:"
            if found["model_threshold"] is None:
                lines.append(f"{head} none, {found['reason']}.")
            else:
                lines.append(
                    f"{head} `decision_threshold: {threshold(found)}`, {positive} recall "
                    f"{pct(found['recall'])}, precision {pct(found['precision'])}, "
                    f"{found['fp']} of {found['negatives']} `{negative}` rows called "
                    f"`{positive}` ({pct(found['false_positive_rate'])})."
                )
    return lines


def can_plot() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def draw_plots(folder: Path, columns: Mapping[str, Judgements], labels: list[str]) -> list[str]:
    """Per servable, a histogram of the positive label's score per expected label, and one
    precision-recall curve of them all; the files' names, relative to `folder`."""
    if len(labels) != 2 or not can_plot():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positive = labels[1]
    names: list[str] = []
    for index, (name, judged) in enumerate(columns.items()):
        figure, axes = plt.subplots(figsize=(6, 3.5))
        for code, label in enumerate(labels):
            scores = array("d", (score for e, score in judged.counted() if e == code))
            axes.hist(scores, bins=HISTOGRAM_BINS, range=(0, 1), alpha=0.6, label=label)
        axes.set(title=f"{name}: score of {positive} by expected label", xlabel="served score")
        axes.set_yscale("log")
        axes.legend(title="expected")
        file = f"histogram-{index}.png"
        figure.tight_layout()
        figure.savefig(folder / file, dpi=100)
        plt.close(figure)
        names.append(file)
    figure, axes = plt.subplots(figsize=(5, 4))
    for name, judged in columns.items():
        recall, precision = precision_recall_curve(judged.sweep())
        axes.plot(recall, precision, label=name)
    axes.set(title=f"precision-recall of {positive}", xlabel="recall", ylabel="precision")
    axes.legend()
    figure.tight_layout()
    figure.savefig(folder / "precision-recall.png", dpi=100)
    plt.close(figure)
    return [*names, "precision-recall.png"]
