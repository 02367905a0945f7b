"""posenc.eval.load_run on a run directory written in the test by the built `posenc eval` (stories260K, one task,
two lengths): the records are the run's own files, plain dicts that pandas.DataFrame would take."""
import csv
import json

import pytest

import posenc


@pytest.fixture(scope="module")
def run_dir(shared, cli, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "runs"
    m = shared / "models" / "stories260K"
    cli("eval", "--model", m / "stories260K.bin", "--tokenizer", m / "tok512.bin", "--haystack",
        shared / "data" / "tinystories_val.txt", "--tasks", "name_recall", "--context", "128,256", "--depths", "0.5",
        "--samples", 6, "--ppl-tokens", 2048, "--quiet", "--out", out)
    return out


def test_load_run_reads_the_cli_run(run_dir):
    run = posenc.eval.load_run(run_dir)  # the --out directory: its LATEST names the run
    assert run.path.endswith(run.run_id)
    assert run.incomplete == []
    with open(f"{run.path}/summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(run.cells) == len(rows) > 0
    for rec, row in zip(run.cells, rows):
        assert set(rec) == set(row)
        assert rec["task"] == row["task"] == "name_recall"
        assert rec["length"] == int(row["length"]) and rec["n"] == int(row["n"])
        if row["accuracy"]:
            assert rec["accuracy"] == pytest.approx(float(row["accuracy"]))
            assert rec["correct"] / rec["n"] == pytest.approx(rec["accuracy"], abs=1e-6)
        assert isinstance(rec["primary"], bool)
    assert {r["length"] for r in run.cells} == {128, 256}
    with open(f"{run.path}/samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert run.samples == samples and len(samples) > 0
    assert run.run == json.load(open(f"{run.path}/run.json"))
    # Perplexity buckets, one record per (scaling, context, bucket), matching ppl.json.
    ppl = json.load(open(f"{run.path}/ppl.json"))
    assert len(run.ppl) == sum(len(r["buckets"]) for r in ppl["results"]) > 0
    for rec in run.ppl:
        assert all(not isinstance(v, (list, dict)) for v in rec.values())  # flat: one DataFrame column each
    # The run directory itself loads the same.
    assert posenc.eval.load_run(run.path).cells == run.cells


def test_load_run_errors(tmp_path):
    with pytest.raises(posenc.IoError):
        posenc.eval.load_run(tmp_path)
    (tmp_path / "LATEST").write_text("../elsewhere\n")
    with pytest.raises(posenc.DataError, match="LATEST"):
        posenc.eval.load_run(tmp_path)
