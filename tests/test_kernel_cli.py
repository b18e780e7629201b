"""`k3 verify-equivalence` and `k3 bench-kernel` wiring (the kernels' own accuracy is tested in tests/ops)."""

import json
import re

import pytest
from typer.testing import CliRunner

from k3cli.cli import app

runner = CliRunner()
needs_triton = pytest.mark.triton


@needs_triton
def test_verify_gate_passes_and_prints_table():
    r = runner.invoke(app, ["verify-equivalence", "--kernel", "kda_gate", "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    assert "dg_raw" in r.output and "passed, 0 failed" in r.output


@needs_triton
def test_verify_json_rows():
    r = runner.invoke(app, ["verify-equivalence", "--kernel", "kda_gate", "--dtype", "fp32", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert rows and all(row["passed"] and row["rel_rms"] <= row["tol"] for row in rows)
    assert {"dg_raw", "dA_log", "ddt_bias"} <= {row["name"].split("/")[-1] for row in rows}


@needs_triton  # in-process: the interpreter must be on before any kernel module was imported
def test_verify_failure_exits_4(monkeypatch):
    import k3cli.bench.kernels as kernels

    monkeypatch.setattr(kernels, "run_verify", lambda ks, shapes, dt: [
        ("chunk_kda", "case/o", 1e-3, 1e-3, 5e-3, True), ("chunk_kda", "case/dq", 0.5, 1.0, 8e-3, False)])
    r = runner.invoke(app, ["verify-equivalence", "--kernel", "chunk_kda", "--dtype", "fp32"])
    assert r.exit_code == 4
    assert "1 of 2 checks exceed their tolerance" in r.stderr


@needs_triton
def test_verify_table_puts_each_tolerance_beside_the_error_it_bounds(monkeypatch):
    """The tolerance bounds the relative RMS error: it stands beside that column, and the max abs error is
    labelled as unbounded (before: the tolerance stood beside the max abs error)."""
    import k3cli.bench.kernels as kernels

    monkeypatch.setattr(kernels, "run_verify", lambda ks, shapes, dt: [
        ("chunk_kda", "case/o", 1.25e-3, 7.5e-1, 5e-3, True)])
    r = runner.invoke(app, ["verify-equivalence", "--kernel", "chunk_kda", "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    header = next(line for line in r.stdout.splitlines() if "rel RMS err" in line)
    cells = lambda line: [c.strip() for c in re.split("[┃│]", line)[1:-1]]
    assert cells(header)[2:] == ["rel RMS err", "rel RMS tol", "", "max abs err (info)"]
    row = next(line for line in r.stdout.splitlines() if "case/o" in line)
    assert cells(row)[2:] == ["1.25e-03", "5.0e-03", "pass", "7.50e-01"]
    assert "pass: rel RMS err ≤ rel RMS tol; max abs err is not bounded" in r.stdout


def _gpu_rows(kernel: str, fla: bool) -> list[dict]:
    """Rows with the widest values a GPU run gives (k3 shapes, H200 times), every column of --wide filled."""
    from k3cli.bench.kernels import BENCH_COLUMNS, BENCH_COLUMNS_NARROW

    ints = {"B": 256, "N": 65536, "T": 32768, "H": 32, "HV": 32, "K": 128, "L": 31, "D": 4096, "C": 1024, "norm_dim": 128,
            "V": 32768}
    floats = {".3f": 21.243, ".4f": 0.0123, ".1f": 123.4, ".0f": 4812.0, ".1%": 0.987, ".0%": 0.987, ".2f": 12.34,
              ".4g": 1234.5}
    texts = {"form": "block S=2", "documents": "True"}
    cols = (BENCH_COLUMNS[kernel] or []) + BENCH_COLUMNS_NARROW[kernel]
    row = {k: ints[k] if spec == "d" else texts[k] if spec == "s" else floats[spec] for k, _, spec in cols}
    row.update({k: None for k in row if k.startswith("fla_") and "doc" not in k and "ref" not in k and not fla})
    if kernel == "linear_ce":   # its --wide table is every key of the row
        row.update({"kernel": "linear_ce", "dtype": "torch.bfloat16", "ours_loss": 10.43, "ours_vs_torch": 1.21})
    if kernel == "kda_gate":   # its --wide table is every key of the row
        row.update({"kernel": "kda_gate", "dtype": "torch.bfloat16", "first_call_fwd_s": 0.731,
                    "first_call_fwd_bwd_s": 2.214, "fwd_p20_ms": 0.41, "fwd_p80_ms": 0.42})
    return [row, dict(row)]


@needs_triton
@pytest.mark.parametrize("fla", [False, True])
def test_bench_table_fits_100_columns_and_wide_shows_every_column(monkeypatch, fla):
    """At GPU widths (before: 22 columns cut to 'first_ca…'), with and without fla timed in the run."""
    import k3cli.bench.kernels as kernels
    from k3cli.bench.kernels import BENCH_COLUMNS, BENCH_KERNELS

    results = {k: _gpu_rows(k, fla) for k in BENCH_KERNELS}
    monkeypatch.setattr(kernels, "run_bench", lambda ks, shapes, against, custom=None: results)
    r = runner.invoke(app, ["bench-kernel", "--shapes", "ci"])
    assert r.exit_code == 0, r.output
    assert max(map(len, r.stdout.splitlines())) <= 100 and "…" not in r.stdout, r.stdout
    assert ("fla f+b" in r.stdout) == fla and ("fla† f+b" in r.stdout) != fla   # published figures only in their stead
    assert r.stdout.count("×torch f+b") == 2 and "×compiled f+b" in r.stdout   # no header wrapped either
    r = runner.invoke(app, ["bench-kernel", "--shapes", "ci", "--wide"])
    assert r.exit_code == 0 and "…" not in r.stdout, r.stdout
    headers = {h for k in BENCH_KERNELS for _, h, _ in BENCH_COLUMNS[k] or []} | {"first_call_fwd_bwd_s"}
    assert all(h in r.stdout for h in headers), [h for h in headers if h not in r.stdout]


@needs_triton
def test_bench_gate_ci_table_fits_100_columns():
    r = runner.invoke(app, ["bench-kernel", "--kernel", "kda_gate", "--shapes", "ci"])
    assert r.exit_code == 0, r.output
    assert "× torch f+b" in r.stdout and max(map(len, r.stdout.splitlines())) <= 100 and "…" not in r.stdout


@needs_triton
def test_bench_gate_ci_json():
    r = runner.invoke(app, ["bench-kernel", "--kernel", "kda_gate", "--shapes", "ci", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    rows = data["results"]["kda_gate"]
    assert rows and all(row["fwd_ms"] > 0 for row in rows)


@needs_triton
def test_linear_ce_verifies_and_benches():
    """The chunked loss: every verify row passes (loss, dh, dw against F.cross_entropy on full logits), and the
    bench times it beside the full-logits loss on the same inputs, the two losses equal."""
    r = runner.invoke(app, ["verify-equivalence", "--kernel", "linear_ce", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert len(rows) == 9 and all(row["passed"] for row in rows)
    r = runner.invoke(app, ["bench-kernel", "--kernel", "linear_ce", "--shapes", "ci", "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["results"]["linear_ce"]
    assert row["torch_ms"] > 0 and row["ours_ms"] > 0 and row["ours_vs_torch"] == row["torch_ms"] / row["ours_ms"]
    assert abs(row["ours_loss"] - row["torch_loss"]) < 1e-5 * row["torch_loss"]
    assert row["liger_ms"] is None and row["cce_ms"] is None   # CUDA libraries: timed on a GPU only


def test_parse_shape(capsys):
    import typer

    from k3cli.cli import parse_shape
    assert parse_shape("8, 2048,16,16,128") == (8, 2048, 16, 16, 128)
    for bad, msg in (("8,2048,16,16", "five positive integers"), ("8,x,16,16,128", "five positive integers"),
                     ("8,2048,0,16,128", "five positive integers"), ("1,64,3,4,16", "multiple of H=3")):
        with pytest.raises(typer.Exit) as e:
            parse_shape(bad)
        assert e.value.exit_code == 2
        assert msg in capsys.readouterr().err


def test_bad_kernel_args_exit_2():
    assert runner.invoke(app, ["bench-kernel", "--shapes", "huge"]).exit_code == 2
    assert runner.invoke(app, ["bench-kernel", "--against", "xformers"]).exit_code == 2
    assert runner.invoke(app, ["verify-equivalence", "--kernel", "nope"]).exit_code == 2
    r = runner.invoke(app, ["verify-equivalence", "--shapes", "medium"])
    assert r.exit_code == 2 and "--shapes must be ci or full" in r.stderr


@needs_triton
def test_cpu_refuses_gpu_only_requests():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    r = runner.invoke(app, ["bench-kernel", "--shapes", "k3"])
    assert r.exit_code == 2 and "only --shapes ci" in r.stderr
    r = runner.invoke(app, ["verify-equivalence", "--dtype", "bf16"])
    assert r.exit_code == 2 and "bf16 needs a GPU" in r.stderr


@needs_triton
def test_verify_decode_kernel():
    r = runner.invoke(app, ["verify-equivalence", "--kernel", "decode", "--dtype", "fp32", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert {"o", "ht"} == {row["name"].split("/")[-1] for row in rows}
    assert all(row["passed"] for row in rows)


def test_bench_flags_a_launch_bound_pass():
    """The host-enqueue note of a bench progress line: named for its pass, flagged from 60 % of the device time
    (the toy chunk_kda backward: 1.97 ms to enqueue a 1.955 ms forward+backward)."""
    from k3cli.ops.kda.bench import _host_note
    assert _host_note(None, 1.0, flag=True) == ""
    note = _host_note(1.97, 1.955, flag=True, what="forward+backward")
    assert "1.97 ms per forward+backward" in note and "near launch-bound, the forward+backward figure" in note
    assert "launch-bound" not in _host_note(0.2, 1.0, flag=True)
    assert "launch-bound" not in _host_note(1.97, 1.955)


@needs_triton
def test_bench_chunk_row_has_both_host_times():
    """Each chunk_kda row carries the host's enqueue time of both passes (None off CUDA), and the unbounded
    call's times with their ratio to the bounded one; the table shows them."""
    import torch

    from k3cli.bench.kernels import BENCH_COLUMNS
    from k3cli.ops.kda.bench import _bench_chunk
    row = _bench_chunk((1, 16, 1, 1, 16), torch.device("cpu"), against_fla=False)
    assert "host_fwd_ms" in row and "host_fwd_bwd_ms" in row and row["fwd_bwd_ms"] > 0
    assert row["unbounded_fwd_bwd_ms"] > 0
    assert row["unbounded_vs_bounded_fwd_bwd"] == row["unbounded_fwd_bwd_ms"] / row["fwd_bwd_ms"]
    shown = [key for key, _, _ in BENCH_COLUMNS["chunk_kda"]]
    assert {"host_fwd_ms", "host_fwd_bwd_ms", "unbounded_fwd_bwd_ms", "unbounded_vs_bounded_fwd_bwd"} <= set(shown)
