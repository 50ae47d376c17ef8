"""The disk compile cache and ``python -m moe_ep.aot`` (CPU: sm_90a builds, no GPU needed).

Every build runs in a fresh process, as ranks and engine restarts do: the in-memory cache of this
test process never hides the disk cache.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

EVENT = re.compile(r"^\s+(\S+)\s+(compiled|loaded|rebuilt)\s+([0-9.]+) s$", re.M)
SMALL = ["--model", "qwen3", "--max-tokens", "64"]
#: the layout kernels of a one-rank layer (LocalRoute's two included: the one-rank default)
LAYOUT_1 = ["layout_count", "layout_place", "layout_place_nogather", "layout_route", "layout_route_i64"]
NL = len(LAYOUT_1)


def aot(*args, cache=None, timeout=600, env_extra=None):
    env = dict(os.environ)
    if cache is not None:
        env["MOE_EP_CACHE_DIR"] = str(cache)
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "moe_ep.aot", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p


def events(p):
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [(n, a, float(s)) for n, a, s in EVENT.findall(p.stdout)]


def test_second_build_is_all_hits_and_10x_faster(tmp_path):
    first = events(aot("build", *SMALL, "--kernels", "fc2,layout", "--out", str(tmp_path)))
    assert [a for _, a, _ in first] == ["compiled"] * (1 + NL)  # FC2 + the layout kernels
    second = events(aot("build", *SMALL, "--kernels", "fc2,layout", "--out", str(tmp_path)))
    assert [n for n, _, _ in second] == [n for n, _, _ in first]
    assert [a for _, a, _ in second] == ["loaded"] * (1 + NL)
    t_compile, t_load = sum(s for *_, s in first), sum(s for *_, s in second)
    assert t_load * 10 <= t_compile, (t_compile, t_load)
    listed = aot("list", "--dir", str(tmp_path))
    assert f"{1 + NL} entries" in listed.stdout and "sm90-megamoe-v" in listed.stdout
    assert aot("verify", "--dir", str(tmp_path)).returncode == 0
    assert not list(tmp_path.rglob(".tmp-*")), "temporary export folders left behind"


def test_corrupt_and_stale_entries_are_rebuilt(tmp_path):
    events(aot("build", *SMALL, "--kernels", "layout", "--out", str(tmp_path)))
    objs = sorted(tmp_path.rglob("layout_count-*.o"))
    metas = sorted(tmp_path.rglob("layout_place-*.json"))
    assert len(objs) == 1 and len(metas) == 1
    data = bytearray(objs[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the object file
    objs[0].write_bytes(bytes(data))
    metas[0].write_text(metas[0].read_text()[:40])  # a torn metadata file
    bad = aot("verify", "--dir", str(tmp_path))
    assert bad.returncode == 1 and "checksum mismatch" in bad.stdout and "unreadable metadata" in bad.stdout
    p = aot("build", *SMALL, "--kernels", "layout", "--out", str(tmp_path))
    acts = {n: a for n, a, _ in events(p)}
    assert acts == {n: "rebuilt" if n in ("layout_count", "layout_place") else "loaded" for n in LAYOUT_1}
    assert p.stderr.count("CompileCacheWarning") == 2 and "rebuilding it" in p.stderr
    assert aot("verify", "--dir", str(tmp_path)).returncode == 0


def test_keys_do_not_mix(tmp_path):
    """Another token capacity is another kernel (layout kernels are compiled for it); the first
    capacity's entries stay and are still hits."""
    events(aot("build", *SMALL, "--kernels", "layout", "--out", str(tmp_path)))
    other = events(aot("build", "--model", "qwen3", "--max-tokens", "128", "--kernels", "layout",
                       "--out", str(tmp_path)))
    assert [a for _, a, _ in other] == ["compiled"] * NL
    again = events(aot("build", *SMALL, "--kernels", "layout", "--out", str(tmp_path)))
    assert [a for _, a, _ in again] == ["loaded"] * NL
    assert f"{2 * NL} entries" in aot("list", "--dir", str(tmp_path)).stdout


def test_eight_ranks_building_at_once_compile_each_kernel_once(tmp_path):
    """Eight processes (as 8 torchrun ranks on one machine) build the same kernels into one
    cache at the same moment: each kernel is compiled by exactly one of them, the others load
    it; every entry is complete (no torn files, nothing left in temporary folders)."""
    env = dict(os.environ, MOE_EP_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "moe_ep.aot", "build", *SMALL, "--kernels", "fc2,layout"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(8)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    evs = [e for out, _ in outs for e in EVENT.findall(out)]
    compiled = sorted(n for n, a, _ in evs if a == "compiled")
    assert compiled == sorted(["gemm_identity", *LAYOUT_1])
    assert sum(a == "loaded" for _, a, _ in evs) == 7 * (1 + NL)
    assert f"{1 + NL} entries" in aot("list", "--dir", str(tmp_path)).stdout
    assert aot("verify", "--dir", str(tmp_path)).returncode == 0
    assert not list(tmp_path.rglob(".tmp-*"))


def test_a_changed_source_byte_changes_the_namespace(tmp_path):
    from moe_ep.shim import drop_src, sm90_cache_namespace
    from moe_ep.shim.disk_cache import source_fingerprint

    src = drop_src("sm90", "megamoe")
    fp = source_fingerprint(src)
    assert fp[:16] in sm90_cache_namespace()
    copy = tmp_path / "src"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_fingerprint(copy) == fp
    f = copy / "sm90_megamoe" / "constants.py"
    f.write_bytes(f.read_bytes().replace(b"MAX_EXPERTS = 1024", b"MAX_EXPERTS = 1025"))
    assert source_fingerprint(copy) != fp
    (copy / "sm90_megamoe" / "__pycache__").mkdir(exist_ok=True)
    (copy / "sm90_megamoe" / "__pycache__" / "x.pyc").write_bytes(b"junk")  # caches do not count
    f.write_bytes(f.read_bytes().replace(b"MAX_EXPERTS = 1025", b"MAX_EXPERTS = 1024"))
    assert source_fingerprint(copy) == fp


def test_cache_dir_values(monkeypatch, tmp_path):
    """MOE_EP_CACHE_DIR: a directory; 0 / off / none / false turn the cache off; unset or empty is the
    default folder (``$XDG_CACHE_HOME/moe_ep``), as for every variable moe_ep reads."""
    from moe_ep.shim import disk_cache

    monkeypatch.setattr(disk_cache, "_root_override", "unset")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for raw, want in ((str(tmp_path / "c"), tmp_path / "c"), ("", tmp_path / "xdg" / "moe_ep"),
                      ("off", None), ("0", None), ("None", None), ("false", None)):
        monkeypatch.setenv("MOE_EP_CACHE_DIR", raw)
        assert disk_cache.cache_root() == want, raw
    monkeypatch.delenv("MOE_EP_CACHE_DIR")
    assert disk_cache.cache_root() == tmp_path / "xdg" / "moe_ep"


def test_disabled_cache_writes_nothing(tmp_path):
    p = aot("build", *SMALL, "--kernels", "layout", env_extra={"MOE_EP_CACHE_DIR": "off"},
            cache=None)
    assert p.returncode == 2 and "disabled" in p.stderr
    from moe_ep.shim import compile_cache_root, disk_cache, set_compile_cache_dir

    built = []
    set_compile_cache_dir(None)
    try:
        assert compile_cache_root() is None
        with pytest.MonkeyPatch.context() as mp:  # were the switch ignored, the entry would land here
            mp.setenv("MOE_EP_CACHE_DIR", str(tmp_path))
            fn = disk_cache.get_or_build("probe-ns", "probe", ("k", 1), lambda: built.append(1) or "kernel")
    finally:
        set_compile_cache_dir("env")
    assert fn == "kernel" and built == [1] and list(tmp_path.iterdir()) == []
    assert (disk_cache.EVENTS[-1].name, disk_cache.EVENTS[-1].action, disk_cache.EVENTS[-1].path) == \
        ("probe", "compiled", None)
    assert compile_cache_root() == Path(os.environ["MOE_EP_CACHE_DIR"]).expanduser()


def test_launch_mode_is_part_of_the_key(tmp_path):
    """TVM-FFI (default with apache-tvm-ffi installed) and classic kernels are different objects:
    separate entries, each marked, each loading back as what it is."""
    pytest.importorskip("tvm_ffi")
    import json

    ffi = events(aot("build", *SMALL, "--kernels", "layout", "--out", str(tmp_path)))
    classic = events(aot("build", *SMALL, "--kernels", "layout", "--out", str(tmp_path),
                         env_extra={"MOE_EP_TVM_FFI": "0"}))
    assert [a for _, a, _ in ffi] == [a for _, a, _ in classic] == ["compiled"] * NL
    metas = [json.loads(p.read_text()) for p in tmp_path.rglob("layout_*.json")]
    assert sorted(m["tvm_ffi"] for m in metas) == [False] * NL + [True] * NL
    assert aot("verify", "--dir", str(tmp_path)).returncode == 0
    bad = aot("build", *SMALL, "--kernels", "layout", "--out", str(tmp_path), env_extra={"MOE_EP_TVM_FFI": "2"})
    assert bad.returncode != 0 and "MOE_EP_TVM_FFI" in bad.stderr


def test_unknown_arch_and_model_refused(tmp_path):
    p = aot("build", "--arch", "sm_80", *SMALL, "--out", str(tmp_path))
    assert p.returncode == 2 and "sm_80" in p.stderr and "sm_90a" in p.stderr
    p = aot("build", "--model", "llama", "--out", str(tmp_path))
    assert p.returncode == 2 and "unknown model" in p.stderr


@pytest.mark.gpu
def test_loaded_kernels_give_bit_identical_results(tmp_path):
    """GPU: a layer whose kernels come from a prebuilt cache (built by `moe_ep.aot` in another
    process) gives bit-identical output to a layer that compiled its kernels itself."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    events(aot("build", *SMALL, "--out", str(tmp_path / "cache")))
    script = r"""
import sys, torch
from moe_ep.api import EPGroup, MoEConfig, MoELayer
cfg = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=64)
g = torch.Generator().manual_seed(5)
x = torch.randn(64, 2048, generator=g).to(torch.bfloat16).cuda()
ids = torch.randn(64, 128, generator=g).topk(8, -1).indices.to(torch.int32).cuda()
w = torch.softmax(torch.randn(64, 8, generator=g), -1).cuda()
w13 = (torch.randn(128, 1536, 2048, generator=g) * 0.02).to(torch.bfloat16).cuda()
w2 = (torch.randn(128, 2048, 768, generator=g) * 0.03).to(torch.bfloat16).cuda()
msgs = []
with MoELayer(cfg, EPGroup.single(), backend="sm90_bf16_cutedsl") as layer:
    layer.warmup(progress=msgs.append)
    out = layer.forward(x, ids, w, w13, w2)
    torch.cuda.synchronize()
torch.save(out.cpu(), sys.argv[1])
print("\n".join(msgs))
"""
    res = {}
    for name, cache, ffi in (("loaded", tmp_path / "cache", "auto"), ("fresh", "off", "auto"),
                             ("classic", "off", "0")):
        env = dict(os.environ, MOE_EP_CACHE_DIR=str(cache), MOE_EP_TVM_FFI=ffi)
        p = subprocess.run([sys.executable, "-c", script, str(tmp_path / f"{name}.pt")], capture_output=True,
                           text=True, timeout=600, env=env)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        res[name] = p.stdout
    # every kernel the layer needs came from the prebuilt cache: as many loads as the fresh run's
    # compiles (12 before the one-rank LocalRoute and the token-adaptive layout grid; more since)
    n = res["fresh"].count("compiled in")
    assert n >= 12 and "loaded in" not in res["fresh"], res["fresh"]
    assert "compiled" not in res["loaded"] and res["loaded"].count("loaded in") == n, res["loaded"]
    a, b = torch.load(tmp_path / "loaded.pt"), torch.load(tmp_path / "fresh.pt")
    assert torch.equal(a, b)
    # the classic launch path (CuTe tensors, explicit stream) computes the same bits as TVM-FFI
    assert torch.equal(a, torch.load(tmp_path / "classic.pt"))
    assert torch.isfinite(a.float()).all() and a.float().abs().sum() > 0


def test_aot_builds_fp8_layers_for_sm90(tmp_path):
    """``--quant fp8_block128`` on sm_90a builds the FP8 backend's kernels (here FC2 and its input
    quantiser); with another arch it is refused by name."""
    names = [n for n, _, _ in events(aot("build", *SMALL, "--quant", "fp8_block128", "--kernels", "fc2",
                                         "--out", str(tmp_path)))]
    assert sorted(names) == ["fp8_gemm_identity_cluster2_defer", "fp8_quantize_rows"]  # K 768: short-K, deferred epilogue
    bad = aot("build", "--arch", "sm_100a", "--quant", "fp8_block128", "--model", "qwen3", "--out", str(tmp_path))
    assert bad.returncode == 2 and "--quant fp8_block128 is for --arch sm_90a" in bad.stderr
