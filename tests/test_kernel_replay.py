"""Cache manifests: ``python -m moe_ep.aot manifest`` lists a cache's kernels by key and ``replay``
compiles them again elsewhere (CPU: sm_90a builds, no GPU needed). The rebuilt cache must hold the
very entries (file names and keys) of the original, a stale manifest must give today's kernels,
and a manifest entry that cannot be built here must be skipped with its reason, never evaluated.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--model", "qwen3", "--max-tokens", "64"]


def aot(*args, cache=None, timeout=600):
    env = dict(os.environ)
    if cache is not None:
        env["MOE_EP_CACHE_DIR"] = str(cache)
    p = subprocess.run([sys.executable, "-m", "moe_ep.aot", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def entries(root: Path) -> dict:
    """object file name -> recorded key, for every committed entry under ``root``."""
    return {p.with_suffix(".o").name: json.loads(p.read_text())["key"] for p in root.rglob("*.json")}


def test_parse_key_accepts_recorded_keys_only():
    from moe_ep.shim.drops.sm90_megamoe_layout import LayoutKey
    from moe_ep.shim.drops.sm100_w4a16 import W4A16Key
    from moe_ep.shim.kernel_replay import parse_key, refreshed

    key = LayoutKey(114, 3, "4.8.1", "sm_90a", 2048, 8, 1, 8192, 128, True)
    assert parse_key(repr((key, "place"))) == (key, "place")
    assert parse_key(repr(key)) == (key, None)
    for text, why in [("__import__('os').system('true')", "not one of the replayed key classes"),
                      ("LayoutKey(114, 3)", "positional"),
                      (repr(key).replace("route=False", "route=False, rows=4"), "no field"),
                      (repr(key).replace("hidden=2048", "hidden=len('ab')"), "malformed node"),
                      (repr((key, 3)), "kind must be a string"),
                      (repr(key)[:-1], "not a key repr"),
                      (repr(key).replace("hidden=2048, ", "")[:-1] + ", hidden=2048)", None),
                      (repr(key).replace(", route=False", ""), None)]:
        if why is None:
            assert parse_key(text)[0] == key  # field order does not matter, defaults fill in
            continue
        with pytest.raises(ValueError, match=why):
            parse_key(text)
    w4 = W4A16Key(4, 2, "4.8.1", "sm_100a", "clamped_swiglu", 5760, 2880, 128,
                  (("swiglu_alpha", 1.702), ("swiglu_limit", -7.0)), "bfloat16")
    assert parse_key(repr(w4)) == (w4, None)  # tuples of constants: the activation constants
    with pytest.raises(ValueError):
        parse_key(repr(w4).replace("1.702", "abs(-1)"))
    old = LayoutKey(3, 1, "4.0.0", "sm_90a", 2048, 8, 1, 8192, 128, True)
    assert refreshed(old, {"drop_version": 114, "layout_abi_version": 3, "cutlass_version": "4.8.1",
                           "abi_version": 99}) == key  # fields a key lacks are ignored


def test_replay_rebuilds_the_same_entries(tmp_path):
    pytest.importorskip("cutlass")
    src, dst, man = tmp_path / "src", tmp_path / "dst", tmp_path / "kernels.json"
    # a BF16 layer's FC2, EP and layout kernels, an FP8 layer's FC2 and its row quantiser; SM100's
    # clamped SwiGLU W4A16 GEMM (activation constants in its key), SM120's MXFP8 FC2 and row quantiser
    aot("build", *SMALL, "--kernels", "fc2,ep,layout", "--out", str(src))
    aot("build", *SMALL, "--quant", "fp8_block128", "--kernels", "fc2", "--out", str(src))
    aot("build", "--arch", "sm_100a", "--model", "gpt_oss", "--max-tokens", "64", "--kernels", "fc1", "--out", str(src))
    aot("build", "--arch", "sm_120a", *SMALL, "--kernels", "fc2", "--out", str(src))
    want = entries(src)
    names = {n.rsplit("-", 1)[0] for n in want}
    assert {"fp8_quantize_rows", "layout_place", "ep_dispatch", "w4a16_clamped_swiglu", "mxfp8_quantize_rows",
            "mxfp8_row_scale"} <= names, names
    assert any(n.startswith("gemm_") for n in names) and any(n.startswith("fp8_gemm_") for n in names)

    out = aot("manifest", "--dir", str(src), "--out", str(man))
    assert f"0 -> {len(want)} entries" in out.stdout
    assert f"{len(want)} -> {len(want)} entries" in aot("manifest", "--dir", str(src), "--out", str(man)).stdout
    listed = json.loads(man.read_text())
    # stale records (old drop versions) still name today's kernels; five entries cannot be built here
    gemm = next(e for e in listed if e["name"].startswith("gemm_"))
    w4a16 = next(e for e in listed if e["name"].startswith("w4a16_"))
    for e in (gemm, w4a16):
        e["key"] = e["key"].replace("drop_version=", "drop_version=1", 1)
    ns = gemm["namespace"]
    listed += [
        {"namespace": "sm80-ampere-v3-0123456789abcdef/cutlass-dsl-4.8.1/sm_80", "name": "gemm",
         "key": gemm["key"]},
        {"namespace": w4a16["namespace"], "name": "gemm_z", "key": gemm["key"]},
        {"namespace": ns.removesuffix("-pdl"), "name": gemm["name"], "key": gemm["key"]},
        {"namespace": ns, "name": "gemm_x", "key": gemm["key"].replace("handoff=''", "handoff='', lanes=2")},
        {"namespace": ns, "name": "gemm_y", "key": "__import__('os').system('touch pwned')"},
    ]
    man.write_text(json.dumps(listed))

    first = aot("replay", str(man), "--out", str(dst), "--jobs", "2").stdout
    assert entries(dst) == want  # the same files, the same keys
    done = [line for line in first.splitlines() if line.startswith("replay ")]
    assert len(done) == 2, first
    total = {k: sum(int(line.split(f" {k}")[0].rsplit(" ", 1)[-1]) for line in done)
             for k in ("loaded", "compiled", "skipped", "failed")}
    assert total == {"loaded": 0, "compiled": len(want), "skipped": 5, "failed": 0}, first
    assert "drop sm80-ampere-v3-0123456789abcdef is not replayed" in first and "SM90_MEGAMOE_PDL=0" in first
    assert "a GemmKey in drop sm100_w4a16's folder" in first
    assert "no field(s) ['lanes']" in first and "not one of the replayed key classes" in first
    assert not Path("pwned").exists() and not (tmp_path / "pwned").exists()

    again = aot("replay", str(man), "--out", str(dst)).stdout
    assert f"{len(want)} loaded, 0 compiled, 5 skipped, 0 failed" in again
    assert aot("verify", "--dir", str(dst)).returncode == 0
