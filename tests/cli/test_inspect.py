"""``padless inspect``: the four kinds of source, its numbers against a direct computation, its errors.

The data is made here with known sizes. The expected numbers are computed in the test from
those sizes and the batches of padless' samplers (built here with the rule the report states),
never read back from the report.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from padless.cli import main
from padless.cli.sources import InspectError, read_sizes
from padless.loaders import BucketBatchSampler, BudgetBatchSampler, PairBudget, PixelBudget, RandomBatchSampler, TokenBudget
from padless.loaders.synthetic import random_sizes, write_image_folder, write_shards

pytest.importorskip("PIL", reason="images need pillow (pip install 'padless[vision]')")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = [5, 1, 17, 3, 30, 8, 8, 2, 12, 0, 21, 4, 9]


def run_json(capsys, *argv: str) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def expected(sizes: list[tuple[int, ...]], kind: str, batch_size: int, seed: int = 0) -> dict:
    """Occupancy, steps and costs of the three strategies, computed here from the sizes."""
    arr = np.asarray(sizes, dtype=np.int64).reshape(len(sizes), -1)
    feat = {"tokens": lambda e: int(e[0]), "images": lambda e: int(e[0] * e[1]), "pairs": lambda e: int(e[0]) ** 2}[kind]
    attn = {"tokens": lambda e: int(e[0]) ** 2, "images": lambda e: int(e[0] * e[1]) ** 2, "pairs": lambda e: int(e[0]) ** 3}[kind]
    budget_cls = {"tokens": TokenBudget, "images": PixelBudget, "pairs": PairBudget}[kind]
    budget = math.ceil(batch_size * sum(feat(s) for s in arr) / len(arr))
    found = {
        "random": RandomBatchSampler(len(arr), batch_size, seed=seed).batches(0),
        "bucket": BucketBatchSampler(arr, batch_size, num_buckets=8, seed=seed).batches(0),
        "budget": BudgetBatchSampler(arr, budget_cls(budget), seed=seed).batches(0),
    }
    out: dict = {"budget_value": budget}
    for name, batches in found.items():
        assert sorted(i for b in batches for i in b) == list(range(len(arr)))
        real = sum(feat(s) for s in arr)
        padded = sum(len(b) * feat([max(arr[i][d] for i in b) for d in range(arr.shape[1])]) for b in batches)
        real_a = sum(attn(s) for s in arr)
        padded_a = sum(len(b) * attn([max(arr[i][d] for i in b) for d in range(arr.shape[1])]) for b in batches)
        out[name] = {"steps": len(batches), "real": real, "padded": padded, "real_a": real_a, "padded_a": padded_a}
    return out


def check(doc: dict, want: dict, second: str = "attention") -> None:
    assert doc["batching"]["budget"] == want["budget_value"]
    for name in ("random", "bucket", "budget"):
        got, w = doc["strategies"][name], want[name]
        assert got["steps"] == w["steps"], name
        assert got["real"]["features"] == w["real"] and got["padded"]["features"] == w["padded"], name
        assert got["occupancy"] == pytest.approx(w["real"] / w["padded"]), name
        assert got["saving"]["features"] == pytest.approx(w["padded"] / w["real"]), name
        assert got["real"][second] == w["real_a"] and got["padded"][second] == w["padded_a"], name
        assert got["saving"][second] == pytest.approx(w["padded_a"] / w["real_a"]), name


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    shards = write_shards(str(root / "shards"), num_shards=2, per_shard=5, seed=3, low=8, high=40)
    write_image_folder(str(root / "images"), ("cat", "dog"), per_class=4, seed=5, low=8, high=40, corrupt=1)
    (root / "lengths.txt").write_text("# token lengths\n" + "\n".join(map(str, TOKENS)) + "\n")
    return {
        "root": root,
        "shards": shards,
        "shard_sizes": random_sizes(10, seed=3, low=8, high=40),
        "image_sizes": random_sizes(8, seed=5, low=8, high=40),
    }


# ------------------------------------------------------------------------------ the four sources


def test_webdataset_shards_from_a_brace_pattern(data, capsys):
    pattern = os.path.join(os.path.dirname(data["shards"][0]), "shard-{000000..000001}.tar")
    table = read_sizes(pattern)
    assert table.format == "shards" and table.sizes.tolist() == [list(s) for s in data["shard_sizes"]]
    doc = run_json(capsys, pattern, "--batch-size", "3", "--attention")
    assert doc["samples"] == 10 and doc["kind"] == "images" and doc["dims"] == ["H", "W"]
    check(doc, expected(data["shard_sizes"], "images", 3))
    hs = np.array([h for h, _ in data["shard_sizes"]])
    assert doc["sizes"]["H"]["max"] == hs.max() and doc["sizes"]["H"]["p50"] == pytest.approx(np.median(hs))


def test_an_image_folder_reads_headers_and_reports_the_unreadable_file(data, capsys):
    table = read_sizes(str(data["root"] / "images"))
    assert table.format == "images" and table.sizes.tolist() == [list(s) for s in data["image_sizes"]]
    assert len(table.skipped) == 1 and table.skipped[0].startswith(os.path.join("cat", "corrupt0.jpg"))
    doc = run_json(capsys, str(data["root"] / "images"), "--batch-size", "3", "--attention")
    check(doc, expected(data["image_sizes"], "images", 3))
    assert doc["source"]["skipped"] == table.skipped


def test_image_sizes_in_patches(data, capsys):
    doc = run_json(capsys, str(data["root"] / "images"), "--batch-size", "3", "--patch-size", "16")
    patches = [(-(-h // 16), -(-w // 16)) for h, w in data["image_sizes"]]
    assert doc["sizes"]["patches (H*W)"]["max"] == max(h * w for h, w in patches)
    assert doc["batching"]["unit"] == "16x16 patches"
    want = expected(patches, "images", 3)
    assert doc["strategies"]["bucket"]["padded"]["features"] == want["bucket"]["padded"]


def test_a_hugging_face_dataset_saved_to_disk(data, capsys):
    datasets = pytest.importorskip("datasets")
    ids = [list(range(n)) for n in TOKENS]
    path = str(data["root"] / "hf")
    datasets.Dataset.from_dict({"input_ids": ids, "label": [0] * len(ids)}).save_to_disk(path)
    assert read_sizes(path).sizes[:, 0].tolist() == TOKENS  # the first list column
    doc = run_json(capsys, path, "--field", "input_ids", "--batch-size", "4", "--attention")
    assert doc["source"]["detail"] == "list lengths of column 'input_ids'"
    check(doc, expected([(n,) for n in TOKENS], "tokens", 4))
    # a DatasetDict: the split chosen; a length column read as it is
    dd = str(data["root"] / "hfdd")
    ds = datasets.Dataset.from_dict({"n": [2 * t for t in TOKENS]})
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(dd)
    assert read_sizes(dd, length_column="n").sizes[:, 0].tolist() == [2 * t for t in TOKENS]
    assert read_sizes(dd, length_column="n", split="test").sizes[:, 0].tolist() == [2 * t for t in TOKENS[:3]]


def test_a_file_of_lengths_in_each_layout(data, capsys):
    root = data["root"]
    doc = run_json(capsys, str(root / "lengths.txt"), "--budget", "40", "--attention")
    assert doc["samples"] == len(TOKENS) and doc["kind"] == "tokens"
    # a budget alone: random and bucketed batches hold the budget on average
    b = max(1, round(40 / np.mean(TOKENS)))
    assert doc["batching"]["batch_size"] == b
    budget = BudgetBatchSampler([(n,) for n in TOKENS], TokenBudget(40), seed=0).batches(0)
    assert doc["strategies"]["budget"]["steps"] == len(budget)
    assert doc["strategies"]["budget"]["padded"]["features"] == sum(len(x) * max(TOKENS[i] for i in x) for x in budget)
    hw = [(3, 4), (10, 2), (7, 7), (1, 30)]
    (root / "hw.txt").write_text("3x4\n10 x 2\n7X7\n1,30\n")
    (root / "hw.csv").write_text("name,height,width\n" + "".join(f"f{i},{h},{w}\n" for i, (h, w) in enumerate(hw)))
    (root / "hw.json").write_text(json.dumps([list(s) for s in hw]))
    (root / "lens.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in TOKENS))
    (root / "lens.csv").write_text("id,tokens\n" + "".join(f"{i},{n}\n" for i, n in enumerate(TOKENS)))
    np.save(root / "hw.npy", np.asarray(hw))
    for name in ("hw.txt", "hw.csv", "hw.json", "hw.npy"):
        assert read_sizes(str(root / name)).sizes.tolist() == [list(s) for s in hw], name
    assert read_sizes(str(root / "lens.jsonl")).sizes[:, 0].tolist() == TOKENS
    assert read_sizes(str(root / "lens.csv"), length_column="tokens").sizes[:, 0].tolist() == TOKENS
    check(run_json(capsys, str(root / "hw.csv"), "--batch-size", "2", "--attention"), expected(hw, "images", 2))


def test_pairs_price_cells_and_triangle_ops(data, capsys):
    doc = run_json(capsys, str(data["root"] / "lengths.txt"), "--pairs", "--triangle", "--batch-size", "4")
    assert doc["kind"] == "pairs" and doc["models"] == ["features", "triangle"]
    assert doc["sizes"]["cells (N^2)"]["max"] == max(TOKENS) ** 2
    check(doc, expected([(n,) for n in TOKENS], "pairs", 4), second="triangle")


# ------------------------------------------------------------------------------ output


def test_the_text_report_and_the_plot(data, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "inspect.png"
    assert main(["inspect", str(data["root"] / "lengths.txt"), "--batch-size", "4", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| strategy | steps / epoch |" in out and "| random |" in out and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_goes_to_stderr_when_asked(data, capsys):
    pattern = os.path.join(os.path.dirname(data["shards"][0]), "shard-{000000..000001}.tar")
    assert main(["inspect", pattern, "--progress", "--json"]) == 0
    captured = capsys.readouterr()
    assert "scanning 2/2" in captured.err and json.loads(captured.out)["samples"] == 10
    assert main(["inspect", pattern, "--json"]) == 0
    assert capsys.readouterr().err == ""  # not a terminal, not asked


@pytest.mark.slow
def test_python_dash_m_padless_runs_inspect(data):
    r = subprocess.run(
        [sys.executable, "-m", "padless", "inspect", str(data["root"] / "lengths.txt"), "--json"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples"] == len(TOKENS)


# ------------------------------------------------------------------------------ errors


def test_a_missing_path_is_named(data, capsys, tmp_path):
    missing = str(tmp_path / "nowhere" / "lengths.txt")
    with pytest.raises(InspectError, match=f"padless inspect: '{missing}' does not exist"):
        read_sizes(missing)
    assert main(["inspect", missing]) == 2
    assert f"'{missing}' does not exist" in capsys.readouterr().err
    pattern = os.path.join(os.path.dirname(data["shards"][0]), "shard-{000000..000003}.tar")
    with pytest.raises(InspectError, match=r"shard '.*shard-000002.tar' \(from '.*\{000000..000003\}.tar'\) does not exist"):
        read_sizes(pattern)


def test_an_unknown_format_names_the_accepted_ones(tmp_path, capsys):
    f = tmp_path / "data.bin"
    f.write_bytes(b"\0")
    accepted = r"it reads webdataset shards .* an image folder .* a Hugging Face dataset .* a file of lengths"
    with pytest.raises(InspectError, match=f"cannot tell the format of '{f}' from its name; {accepted}.*--format"):
        read_sizes(str(f))
    assert main(["inspect", str(f)]) == 2
    assert "a file of lengths (.txt, .lengths, .csv" in capsys.readouterr().err
    with pytest.raises(InspectError, match=r"unknown format 'parquet'; the formats are shards, images, hf, lengths"):
        read_sizes(str(f), format="parquet")


def test_bad_inputs_are_named(data, tmp_path, monkeypatch):
    bad = tmp_path / "bad.txt"
    bad.write_text("3\n4\nabc\n")
    with pytest.raises(InspectError, match=r"bad.txt:3: 'abc\\n' is not a length or an HxW size"):
        read_sizes(str(bad))
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("3\n4x5\n")
    with pytest.raises(InspectError, match="mixes lengths and HxW sizes"):
        read_sizes(str(mixed))
    with pytest.raises(InspectError, match=r"no image files .* under"):
        read_sizes(str(tmp_path), format="images")
    lengths = str(data["root"] / "lengths.txt")
    images = str(data["root"] / "images")
    for argv, msg in (
        ([lengths, "--triangle"], "--triangle prices the N\\^3 triangle ops of pair data; add --pairs"),
        ([images, "--pairs"], "--pairs takes one N per sample; .* gives H x W sizes"),
        ([lengths, "--patch-size", "16"], "--patch-size applies to images"),
    ):
        with pytest.raises(InspectError, match=msg):
            from padless.cli import parser

            args = parser().parse_args(["inspect", *argv])
            args.run(args)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(InspectError, match=r"--plot needs matplotlib .* pip install 'padless\[plot\]'"):
        from padless.cli import parser

        args = parser().parse_args(["inspect", lengths, "--plot", str(tmp_path / "x.png")])
        args.run(args)


def test_hugging_face_columns_and_splits_are_named(data):
    datasets = pytest.importorskip("datasets")
    path = str(data["root"] / "hf_errors")
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "label": [0, 1]})
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(path)
    with pytest.raises(InspectError, match=r"holds the splits \['a', 'b'\]; choose one with --split"):
        read_sizes(path)
    with pytest.raises(InspectError, match=r"--field 'tokens' is not a column of .* \(columns: \['input_ids', 'label'\]\)"):
        read_sizes(path, split="a", field="tokens")
    with pytest.raises(InspectError, match=r"column 'label' .* not a list or an Image"):
        read_sizes(path, split="a", field="label")


def test_the_docstring_examples_run():
    import doctest

    import padless.cli.report

    failed, attempted = doctest.testmod(padless.cli.report)
    assert attempted and not failed
