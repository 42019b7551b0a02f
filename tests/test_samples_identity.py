"""Issue 50, item 2: a samples file carries its identity. The meta records the prompts' content hash and the samples
file's own record (name, rows, sha256); a continued file whose prompts changed is refused; score refuses an
unfinished file (unless --allow-unfinished) and a meta that is another file's; generate and score refuse an output
that is one of their inputs, before anything is written. A meta an older prefpack wrote (no such fields) still
continues and scores, with a note."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from conftest import quiet, tiny_llama, write_jsonl

from prefpack.cli import main
from prefpack.data.sources import file_sha256
from prefpack.generation.engine import GenerationError, SamplingSettings
from prefpack.generation.hf_engine import TransformersEngine
from prefpack.generation.prompts import RowPrompts
from prefpack.generation.run import sample_prompts
from prefpack.generation.shards import merge_parts, part_path
from prefpack.generation.stops import stop_token_ids

QUESTIONS = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, one_thread):
    """Eight chat prompts in a rows file, a tiny Llama, its engine (3 prompts a batch) and a reward function."""
    root = tmp_path_factory.mktemp("ident")
    rows = write_jsonl(root / "prompts.jsonl", [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS])
    model = tiny_llama(toy_tokenizers["chatml"], root / "model", 0)
    engine = TransformersEngine.load(str(model), pad_id=0, batch_size=3)
    fn = root / "reward.py"
    fn.write_text("def reward(prompt, completion):\n    return float(len(completion))\n")
    return {"root": root, "rows": rows, "model": model, "engine": engine, "tok": str(toy_tokenizers["chatml"]),
            "fn": f"{fn}:reward"}


def source_of(world, rows=None):
    return RowPrompts([str(rows or world["rows"])], world["tok"])


def settings_of(source):
    return SamplingSettings(n=2, max_new_tokens=4, seed=3, stop_token_ids=stop_token_ids(source.tok))


class Killed(Exception):
    pass


class DiesAfterOneBatch:
    """The engine, killed after its first batch (3 of the 8 prompts written)."""

    def __init__(self, engine):
        self.engine, self.name, self.batch_prompts, self.calls = engine, engine.name, engine.batch_prompts, 0

    def generate(self, jobs, s):
        self.calls += 1
        if self.calls > 1:
            raise Killed
        return self.engine.generate(jobs, s)

    def describe(self):
        return self.engine.describe()


def killed_run(world, out, rows=None):
    source = source_of(world, rows)
    with pytest.raises(Killed):
        sample_prompts(source, DiesAfterOneBatch(world["engine"]), settings_of(source), out, log=quiet)
    return out


def whole_run(world, out, rows=None):
    source = source_of(world, rows)
    sample_prompts(source, world["engine"], settings_of(source), out, log=quiet)
    return out


def meta_of(samples):
    return json.loads(samples.with_name(samples.name.removesuffix(".jsonl") + ".meta.json").read_text())


def as_older_meta(samples):
    """The meta as the prefpack before this change wrote it: no prompts hash, no samples record."""
    path = samples.with_name(samples.name.removesuffix(".jsonl") + ".meta.json")
    meta = json.loads(path.read_text())
    meta["prompts"].pop("sha256")
    meta.pop("samples")
    path.write_text(json.dumps(meta, indent=2) + "\n")


def score(*argv):
    return main(["score", *map(str, argv), "--no-progress"])


def one_line_error(capsys, command):
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"prefpack {command}: error: "), err
    return err


# ---------------------------------------------------------------- 1. what the meta records


def test_the_meta_records_the_prompts_hash_and_the_samples_file_it_belongs_to(world, tmp_path):
    out = whole_run(world, tmp_path / "a.jsonl")
    meta = meta_of(out)
    assert meta["prompts"]["sha256"] == {str(world["rows"]): file_sha256(str(world["rows"]))}
    assert meta["samples"] == {"file": "a.jsonl", "expected_rows": 8, "rows": 8,
                               "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    killed = killed_run(world, tmp_path / "k.jsonl")
    assert meta_of(killed)["samples"] == {"file": "k.jsonl", "expected_rows": 8} and not meta_of(killed)["complete"]


def test_ranks_parts_merge_into_the_file_and_meta_one_process_writes(world, tmp_path):
    one = whole_run(world, tmp_path / "one" / "samples.jsonl")
    out = tmp_path / "two" / "samples.jsonl"
    source = source_of(world)
    for rank in range(2):
        sample_prompts(source, world["engine"], settings_of(source), part_path(out, rank, 2), log=quiet,
                       shard=(rank, 2))
    assert meta_of(part_path(out, 1, 2))["samples"]["expected_rows"] == 3  # chunk 1 of three chunks (3, 3, 2)
    merge_parts(out, 2, world["engine"].batch_prompts)
    assert out.read_bytes() == one.read_bytes()
    assert out.with_name("samples.meta.json").read_text() == one.with_name("samples.meta.json").read_text()


# ---------------------------------------------------------------- 2. continuing a file whose prompts changed


def test_a_file_whose_prompts_changed_is_not_continued(world, tmp_path):
    rows = tmp_path / "prompts.jsonl"
    shutil.copy(world["rows"], rows)
    out = killed_run(world, tmp_path / "s.jsonl", rows)
    before = out.read_bytes()
    changed = [{"prompt": [{"role": "user", "content": q.replace("plus", "times")}]} for q in QUESTIONS]
    write_jsonl(rows, changed)  # the same path, other prompts
    source = source_of(world, rows)
    with pytest.raises(GenerationError) as err:
        sample_prompts(source, world["engine"], settings_of(source), out, log=quiet)
    msg = str(err.value)
    assert "\n" not in msg and str(out) in msg and str(rows) in msg and "prompts changed" in msg, msg
    assert out.read_bytes() == before  # nothing touched
    report = sample_prompts(source, world["engine"], settings_of(source), out, log=quiet, overwrite=True)
    assert report.written == 8 and meta_of(out)["prompts"]["sha256"] == {str(rows): file_sha256(str(rows))}


def test_the_command_refuses_to_continue_with_changed_prompts(world, tmp_path, capsys):
    rows = tmp_path / "prompts.jsonl"
    shutil.copy(world["rows"], rows)
    out = tmp_path / "s.jsonl"
    argv = generate_argv(world, [rows], out)
    assert main(argv) == 0
    out.write_text("".join(out.read_text().splitlines(True)[:3]))  # as a run killed after its first batch
    with open(rows, "a") as fh:
        fh.write(json.dumps({"prompt": "one more"}) + "\n")
    capsys.readouterr()
    assert main(argv) == 2
    err = one_line_error(capsys, "generate")
    assert str(out) in err and str(rows) in err and "prompts changed" in err and "--overwrite" in err, err
    assert main(argv + ["--overwrite"]) == 0


def test_an_older_meta_is_continued_with_a_note(world, tmp_path):
    whole = whole_run(world, tmp_path / "whole.jsonl")
    out = killed_run(world, tmp_path / "s.jsonl")
    as_older_meta(out)
    lines = []
    source = source_of(world)
    report = sample_prompts(source, world["engine"], settings_of(source), out, log=lines.append)
    assert report.written == 5 and out.read_bytes() == whole.read_bytes()
    notes = [m for m in lines if m.startswith("note:")]
    assert len(notes) == 1 and "no hash of its prompts" in notes[0] and "\n" not in notes[0]
    assert meta_of(out) == meta_of(whole) | {"samples": {**meta_of(whole)["samples"], "file": "s.jsonl"}}


# ---------------------------------------------------------------- 3. score: unfinished files, foreign metas


def test_score_refuses_an_unfinished_file_unless_asked(world, tmp_path, capsys):
    out = killed_run(world, tmp_path / "s.jsonl")
    assert score(out, "-o", tmp_path / "store", "--reward-fn", world["fn"]) == 2
    err = one_line_error(capsys, "score")
    assert str(out) in err and "3 rows of the 8 prompts" in err and "--allow-unfinished" in err, err
    assert not (tmp_path / "store").exists()
    assert score(out, "-o", tmp_path / "store", "--reward-fn", world["fn"], "--allow-unfinished", "--json") == 0
    captured = capsys.readouterr()
    assert "unfinished" in captured.err and json.loads(captured.out)["rows"] == 3


def test_score_refuses_a_meta_beside_a_renamed_file_that_is_another_runs(world, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    whole_run(world, run / "samples.jsonl")  # this folder's own samples and meta
    other = whole_run(world, tmp_path / "other" / "samples.jsonl", None)
    os.replace(other, run / "renamed.jsonl")  # another run's file, renamed beside them: its meta left behind
    with open(run / "renamed.jsonl", "a") as fh:  # (a file of other rows than the meta's)
        fh.write(run.joinpath("samples.jsonl").read_text().splitlines(True)[0])
    assert score(run / "renamed.jsonl", "-o", tmp_path / "store", "--reward-fn", world["fn"]) == 2
    err = one_line_error(capsys, "score")
    assert "renamed.jsonl" in err and str(run / "samples.meta.json") in err and "'samples.jsonl'" in err, err


def test_score_refuses_a_meta_of_another_file_and_a_file_changed_after(world, tmp_path, capsys):
    a = whole_run(world, tmp_path / "a.jsonl")
    source = source_of(world)
    sample_prompts(source, world["engine"], SamplingSettings(n=2, max_new_tokens=4, seed=9,
                                                             stop_token_ids=stop_token_ids(source.tok)),
                   tmp_path / "b.jsonl", log=quiet)
    shutil.copy(tmp_path / "b.meta.json", tmp_path / "a.meta.json")  # b's meta, put beside a under a's name
    assert score(a, "-o", tmp_path / "s1", "--reward-fn", world["fn"]) == 2
    err = one_line_error(capsys, "score")
    assert str(a) in err and str(tmp_path / "a.meta.json") in err and "'b.jsonl'" in err, err
    # b's own file, rows dropped after generate finished it
    lines = (tmp_path / "b.jsonl").read_text().splitlines(True)
    (tmp_path / "b.jsonl").write_text("".join(lines[:5]))
    assert score(tmp_path / "b.jsonl", "-o", tmp_path / "s2", "--reward-fn", world["fn"]) == 2
    err = one_line_error(capsys, "score")
    assert "holds 5 rows" in err and "8 rows" in err and str(tmp_path / "b.meta.json") in err, err


def test_a_file_renamed_with_its_meta_still_scores(world, tmp_path, capsys):
    whole_run(world, tmp_path / "a.jsonl")
    os.replace(tmp_path / "a.jsonl", tmp_path / "c.jsonl")
    os.replace(tmp_path / "a.meta.json", tmp_path / "c.meta.json")
    assert score(tmp_path / "c.jsonl", "-o", tmp_path / "store", "--reward-fn", world["fn"]) == 0
    assert "records as 'a.jsonl'" in capsys.readouterr().err


def test_an_older_meta_scores_with_a_note_and_its_row_count_checked(world, tmp_path, capsys):
    out = whole_run(world, tmp_path / "s.jsonl")
    as_older_meta(out)
    assert score(out, "-o", tmp_path / "store", "--reward-fn", world["fn"], "--json") == 0
    captured = capsys.readouterr()
    notes = [x for x in captured.err.splitlines() if x.startswith("note:")]
    assert len(notes) == 1 and "older prefpack" in notes[0] and json.loads(captured.out)["rows"] == 8
    out.write_text("".join(out.read_text().splitlines(True)[:6]))
    assert score(out, "-o", tmp_path / "store2", "--reward-fn", world["fn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds 6 rows" in err and "counts 8 prompts" in err and str(tmp_path / "s.meta.json") in err, err


# ---------------------------------------------------------------- 4. an output that is an input


def generate_argv(world, inputs, out, *extra):
    return ["generate", *map(str, inputs), "--model", str(world["model"]), "--tokenizer", world["tok"], "-o", str(out),
            "--n", "2",
            "--max-new-tokens", "4", "--batch-size", "3", *extra]


def test_generate_refuses_an_output_that_is_its_prompts_file(world, tmp_path, capsys):
    rows = tmp_path / "prompts.jsonl"
    shutil.copy(world["rows"], rows)
    before = rows.read_bytes()
    assert main(generate_argv(world, [rows], rows, "--overwrite")) == 2
    err = one_line_error(capsys, "generate")
    assert str(rows) in err and "--output" in err, err
    (tmp_path / "link.jsonl").symlink_to(rows)  # the same file by another name
    assert main(generate_argv(world, [rows], tmp_path / "link.jsonl", "--overwrite")) == 2
    one_line_error(capsys, "generate")
    # the output's meta would be the prompts file: p.jsonl's meta is p.meta.json
    meta_named = tmp_path / "p.meta.json"
    shutil.copy(world["rows"], meta_named)
    assert main(generate_argv(world, [meta_named], tmp_path / "p.jsonl", "--overwrite")) == 2
    err = one_line_error(capsys, "generate")
    assert "its meta" in err and str(meta_named) in err, err
    assert rows.read_bytes() == before and meta_named.read_bytes() == before
    assert not (tmp_path / "prompts.meta.json").exists() and not (tmp_path / "p.jsonl").exists()


def test_score_refuses_an_output_that_is_its_input(world, tmp_path, capsys):
    out = whole_run(world, tmp_path / "run" / "s.jsonl")
    before = out.read_bytes()
    assert score(out, "-o", out, "--reward-fn", world["fn"], "--format", "jsonl", "--overwrite") == 2
    err = one_line_error(capsys, "score")
    assert str(out) in err, err
    assert score(out, "-o", tmp_path / "run", "--reward-fn", world["fn"], "--overwrite") == 2  # a folder holding it
    one_line_error(capsys, "score")
    assert out.read_bytes() == before and (tmp_path / "run" / "s.meta.json").is_file()
