"""Results of the eval lab (`posenc eval`) as plain Python records.

    run = posenc.eval.load_run("runs/")          # a run directory, or the --out directory (its LATEST)
    run.cells      # [{task, control, rope_scaling, length, depth, metric, primary, n, correct, accuracy,
                   #   ci_low, ci_high, status}], one per cell and metric (summary.csv)
    run.samples    # [{...}], one per sample (samples.jsonl)
    run.ppl        # [{rope_scaling, context, start, end, tokens, nll, ...}], one per perplexity bucket (ppl.json)
    pandas.DataFrame(run.cells)                  # any list of these records; posenc itself needs no pandas

Nothing is recomputed: the records are the files `posenc eval` wrote (summary.csv, samples.jsonl, ppl.json), read
after the run directory has been located the way the CLI locates it (posenc::resolve_run_dir). `run.incomplete`
lists what a resume would recompute (missing or damaged cell files, posenc::eval_resume_plan).
"""

import csv as _csv
import json as _json
import os as _os

from . import _posenc

__all__ = ["Run", "load_run"]


def _typed(value):
    """A summary.csv field as int, float, None (empty) or str."""
    if value == "":
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


class Run:
    """One eval run directory. Attributes: path (str), run_id, run (run.json as a dict), summary (summary.json),
    cells / samples / ppl (lists of flat dicts, see the module docstring), incomplete (list of str)."""

    def __init__(self, path, run, summary, cells, samples, ppl, incomplete):
        self.path = path
        self.run = run
        self.run_id = run.get("run_id")
        self.summary = summary
        self.cells = cells
        self.samples = samples
        self.ppl = ppl
        self.incomplete = incomplete

    def __repr__(self):
        return (f"posenc.eval.Run({self.path!r}, run_id={self.run_id!r}, {len(self.cells)} cell rows, "
                f"{len(self.samples)} samples, {len(self.ppl)} ppl buckets)")


def _fail(path, what):
    raise _posenc.DataError(f"{path}: {what}")


def _ppl_records(ppl, path):
    out = []
    if not isinstance(ppl, dict) or not isinstance(ppl.get("results", []), list):
        _fail(path, "expected an object with a list 'results'")
    for i, r in enumerate(ppl.get("results", [])):
        if not isinstance(r, dict) or not isinstance(r.get("buckets", []), list) or \
                not all(isinstance(b, dict) for b in r.get("buckets", [])):
            _fail(path, f"results[{i}]: expected an object with a list of bucket objects 'buckets'")
        head = {k: v for k, v in r.items() if not isinstance(v, (list, dict))}
        for b in r.get("buckets", []):
            row = dict(head)
            # The result's own mean nll/ppl stay under window_* names; the bucket's are the row's.
            for k in ("nll", "ppl", "tokens"):
                if k in head:
                    row["window_" + k] = row.pop(k)
            row.update({k: v for k, v in b.items() if not isinstance(v, (list, dict))})
            out.append(row)
    return out


def load_run(dir):
    """Reads the eval run in `dir` (a run directory holding run.json, or a directory whose LATEST names one) into a
    posenc.eval.Run of plain records. Raises posenc.IoError if neither exists, posenc.DataError for a malformed
    run.json or LATEST, posenc.DataError naming the file for a damaged run.json, summary.json, summary.csv,
    samples.jsonl or ppl.json (not UTF-8, not JSON, a wrong shape, a CSV row of the wrong width). A file that is not
    there (a run still in progress) gives an empty list / dict."""
    if isinstance(dir, (str, bytes, _os.PathLike)):
        dir = _os.fsdecode(_os.fspath(dir))
    else:
        raise TypeError(f"dir: expected a path (str or os.PathLike), got {type(dir).__name__}")
    if "\0" in dir:
        raise ValueError(f"dir: embedded NUL byte in {dir!r}")
    path = _posenc._resolve_run_dir(dir)

    def read_text(p):
        try:
            with open(p, encoding="utf-8", newline="") as f:
                return f.read()
        except UnicodeDecodeError as e:
            _fail(p, f"not UTF-8 text ({e})")

    def read_json(name, default=None, kind=dict):
        p = _os.path.join(path, name)
        if not _os.path.exists(p):
            return default
        try:
            value = _json.loads(read_text(p))
        except ValueError as e:
            _fail(p, f"not valid JSON ({e})")
        if not isinstance(value, kind):
            _fail(p, f"expected a JSON {kind.__name__}, got {type(value).__name__}")
        return value

    run = read_json("run.json")
    incomplete = _posenc._eval_resume_plan(path)
    summary = read_json("summary.json", {})
    cells = []
    csv_path = _os.path.join(path, "summary.csv")
    if _os.path.exists(csv_path):
        reader = _csv.DictReader(read_text(csv_path).splitlines())
        columns = reader.fieldnames or []
        if columns and "primary" not in columns:
            _fail(csv_path, f"no 'primary' column (columns: {', '.join(columns)})")
        for row in reader:
            if None in row or None in row.values():  # more or fewer fields than the header
                _fail(csv_path, f"line {reader.line_num}: {len(columns)} columns in the header, another count here")
            rec = {k: _typed(v) for k, v in row.items()}
            for k in ("task", "control", "rope_scaling", "metric", "status"):  # names stay strings
                if rec.get(k) is not None:
                    rec[k] = str(row[k])
            rec["primary"] = bool(rec["primary"])
            cells.append(rec)
    samples = []
    jsonl = _os.path.join(path, "samples.jsonl")
    if _os.path.exists(jsonl):
        for i, line in enumerate(read_text(jsonl).splitlines()):
            if not line.strip():
                continue
            try:
                samples.append(_json.loads(line))
            except ValueError as e:
                _fail(jsonl, f"line {i + 1}: not valid JSON ({e})")
    ppl_path = _os.path.join(path, "ppl.json")
    ppl = _ppl_records(read_json("ppl.json", {}, kind=object), ppl_path)
    return Run(path, run, summary, cells, samples, ppl, incomplete)
