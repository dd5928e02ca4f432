"""Quantised paths on the CPU: bitsandbytes end to end, the realised-reduction arithmetic, and
what a user sees when a path's library is missing."""

import importlib.util
import json

import pytest
import torch

from conftest import needs_bnb, run_here
from floorline.hardware import lookup
from floorline.measure.cell import measure_cell
from floorline.measure.reduction import describe, reductions, reference_path
from floorline.models import resolve_model
from floorline.paths import REGISTRY, open_session, parse_path, unavailable
from floorline.records import CellKey
from floorline.store import CellRow
from floorline.traffic import floor


def test_reference_paths_keep_the_options():
    assert reference_path(parse_path("bnb-nf4+graphs")) == "hf-static+graphs"
    assert reference_path(parse_path("torchao-int4+compile+graphs")) == "hf-static+compile+graphs"
    assert reference_path(parse_path("engine-int4+verify8")) == "engine+verify8"
    assert reference_path(parse_path("hf-static")) is None


@pytest.mark.parametrize("name", [n for n, p in REGISTRY.items()
                                  if p.facts.library and p.facts.library.module])
def test_a_missing_library_is_an_invalid_cell_saying_what_to_install(name, monkeypatch):
    lib = REGISTRY[name].facts.library
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda m, *a, **k: None if m == lib.module else real(m, *a, **k))
    reason = unavailable(parse_path(name), "cpu")
    assert reason == f"{lib.distribution} is not installed (pip install 'floorline[{lib.extra}]')"
    cell = measure_cell(CellKey("tiny-llama", 16, name, 2, 0), "cpu", lookup("l4"))
    assert (cell.status, cell.reason) == ("invalid", "path unavailable: " + reason)


def test_a_missing_library_through_the_cli(tmp_path, monkeypatch):
    # A path whose module cannot be found: the sweep records the invalid cell and goes on. A
    # fixed warm-up and fewer than 32 timed steps: a busy host cannot make the cell unsteady.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda m, *a, **k: None if m == "torchao" else real(m, *a, **k))
    db = tmp_path / "r.db"
    proc = run_here("sweep", "--db", db, "--models", "tiny-llama", "--ctx", "16", "--paths",
                    "torchao-int4,hf-static", "--steps", "2", "--warmup", "2", "--gpu", "l4")
    assert proc.returncode == 0, proc.stderr
    message = "torchao is not installed (pip install 'floorline[torchao]')"
    assert message in " ".join(proc.stderr.split())  # the console wraps long lines
    shown = json.loads(run_here("show", "--db", db, "--json", check=True).stdout)
    cells = {c["path"]: c for c in shown}
    assert cells["hf-static"]["status"] == "valid"
    assert cells["torchao-int4"]["reason"] == "path unavailable: " + message


def row(id, path, ms, total_bytes, status="valid", reference=None):
    return CellRow(id=id, model="m", ctx=16, path=path, steps=4, warmup=0, gpu="l4",
                   fingerprint_key="k", finished_at="x", status=status, median_ms=ms,
                   total_bytes=total_bytes, details={"reference": reference} if reference else {})


def test_reduction_arithmetic():
    ref = {"path": "hf-static+graphs", "total_bytes": 400}
    rows = [row(1, "hf-static+graphs", 10.0, 400),
            row(2, "bnb-nf4+graphs", 8.0, 100, reference=ref),
            row(3, "bnb-nf4", 30.0, 100, reference={"path": "hf-static", "total_bytes": 400})]
    r = reductions(rows)
    # expected 4x (a quarter of the bytes); realised 10/8 = 1.25x; time saved 20% of the 75%
    # the bytes promise.
    assert r[2]["expected"] == 4 and r[2]["realised"] == 1.25
    assert r[2]["share"] == pytest.approx(0.2 / 0.75)
    assert r[2]["reference_id"] == 1
    assert r[3]["realised"] is None and r[3]["share"] is None  # no hf-static cell to compare with
    assert describe(r[3]) == "4.00x / - (no valid hf-static cell)"
    assert describe(r[2]) == "4.00x / 1.25x (27%)"
    assert 1 not in r
    invalid = reductions([rows[0], row(4, "bnb-int8+graphs", None, 100, "invalid", ref)])[4]
    assert invalid["reference_id"] == 1 and describe(invalid) == "4.00x / -"


@needs_bnb
@pytest.mark.parametrize("name, fmt", [("bnb-nf4", "nf4"), ("bnb-int8", "bnb-int8")])
def test_bnb_path_quantises_every_decoder_linear_and_decodes(name, fmt):
    import bitsandbytes as bnb

    kind = bnb.nn.Linear4bit if fmt == "nf4" else bnb.nn.Linear8bitLt
    with torch.no_grad():
        session = open_session(parse_path(name), resolve_model("tiny-qwen2"), "cpu", 40, seed=1)
        linears = [m for m in session.hf_model.modules() if isinstance(m, torch.nn.Linear)]
        head = session.hf_model.get_output_embeddings()
        assert all(isinstance(m, kind) for m in linears if m is not head)
        assert not isinstance(head, kind) and head.weight.dtype == torch.bfloat16
        session.prefill(16)
        tokens = [session.token.item()]
        for _ in range(4):
            session.step()
            tokens.append(session.token.item())
        session.close()
    assert all(0 <= t < 512 for t in tokens)


@needs_bnb
def test_bnb_nf4_logits_follow_its_dequantised_weights():
    # The nf4 model computes what bf16 linears holding bitsandbytes' own dequantised weights do.
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    with torch.no_grad():
        session = open_session(parse_path("bnb-nf4"), resolve_model("tiny-llama"), "cpu", 40,
                               seed=2)
        model = session.hf_model
        x = torch.randint(512, (1, 12), generator=torch.Generator().manual_seed(0))
        quantised = model(x).logits.float()
        for name, m in list(model.named_modules()):
            if isinstance(m, bnb.nn.Linear4bit):
                w = F.dequantize_4bit(m.weight.data, m.weight.quant_state)
                dense = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                                        dtype=torch.bfloat16)
                dense.weight.copy_(w)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, dense)
        dense_logits = model(x).logits.float()
        session.close()
    err = (quantised - dense_logits).norm() / dense_logits.norm()
    assert err < 2e-2


@needs_bnb
def test_bnb_nf4_stores_what_its_format_counts():
    # The nf4 format's 4.5 bits/weight: 4-bit codes and one fp32 absmax per block of 64.
    with torch.no_grad():
        session = open_session(parse_path("bnb-nf4"), resolve_model("tiny-llama"), "cpu", 40,
                               seed=1)
        for m in session.hf_model.modules():
            if type(m).__name__ == "Linear4bit":
                state = m.weight.quant_state
                stored = m.weight.numel() * m.weight.element_size()
                assert stored * 2 == m.in_features * m.out_features
                assert state.blocksize == 64 and state.absmax.dtype == torch.float32
                assert state.absmax.numel() == m.in_features * m.out_features // 64
                assert state.nested is False  # no double quantisation: that would be nf4-dq
        session.close()


def test_quantised_cell_carries_its_reference_floor():
    cell = measure_cell(CellKey("tiny-llama", 16, "torchao-int4", 2, 0), "cpu", lookup("l4"))
    assert cell.status == "invalid"  # CUDA only, or not installed: either way a reason
    ref = floor(resolve_model("tiny-llama"), lookup("l4"), 16)
    assert cell.details["reference"] == {"path": "hf-static", "total_bytes": ref.total_bytes}
    assert cell.floor["weight_format"] == "int4-g128"


def test_awq_marlin_says_how_to_build_its_kernels(monkeypatch, tmp_path):
    assert unavailable(parse_path("awq-marlin"), "cpu") == "the Marlin kernels run on CUDA only"
    monkeypatch.delenv("FLOORLINE_MARLIN_LIB", raising=False)
    assert "bash third_party/marlin/build.sh" in unavailable(parse_path("awq-marlin"), "cuda")
    monkeypatch.setenv("FLOORLINE_MARLIN_LIB", str(tmp_path / "none.so"))
    assert unavailable(parse_path("awq-marlin"), "cuda").endswith("none.so is not a file")


def test_paths_and_formats_commands(cli):
    paths = cli("paths", "--device", "cpu", check=True).stdout
    for name in REGISTRY:
        assert name in paths
    assert "the Marlin kernels run on CUDA only" in " ".join(paths.split())  # the console wraps
    formats = cli("formats", check=True).stdout
    assert "gptq-int4-g128" in formats and "4.156" in formats and "gguf-q4_0" in formats
