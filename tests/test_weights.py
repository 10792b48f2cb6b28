"""shmcache.models.weights: a model's weights over one read-only shared file mapping.

Models loaded with load_model_shared give exactly mlx_lm.load's logits and
tokens (float32, bfloat16, and quantized with a per-layer override); their
arrays lie in a read-only mapping of the (aligned) safetensors file; three
real processes that load one ~100 MB model hold about one copy of it in
summed PSS, and killing one changes nothing for the others.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import psutil
import pytest
from mlx.utils import tree_flatten

from shmcache.models import weights
from shmcache.models.demo_model import build_model_dir

pytestmark = pytest.mark.skipif(weights._native()[0] is None,
                                reason=f"weights cannot be mapped here: {weights._native()[1]}")

SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=256)
# about 100 MB of float32 weights: the PSS test's model
MEDIUM = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, intermediate_size=2816)
PROMPT = "The quick brown fox jumps over the lazy dog."
HELPER = str(Path(__file__).with_name("_weights_proc.py"))


@pytest.fixture(autouse=True)
def weights_dir(tmp_path, monkeypatch):
    """Aligned copies go under this test's tmp_path (inherited by its subprocesses)."""
    d = tmp_path / "aligned"
    monkeypatch.setenv("SHMCACHE_WEIGHTS_DIR", str(d))
    return d


def make_unaligned(path: Path) -> Path:
    """Rewrite path/model.safetensors as mx.save_safetensors writes (an unpadded
    header), with metadata of a length that puts the first tensor at an odd
    offset; return the file."""
    f = path / "model.safetensors"
    arrays = mx.load(str(f))
    for pad in range(8):
        mx.save_safetensors(str(f), arrays, metadata={"format": "mlx", "pad": "x" * pad})
        _, tensors = weights.read_safetensors_header(f)
        if tensors[0].start % 2:
            return f
    raise AssertionError("no metadata length gave an odd offset")


def quantized_dir(src: Path, dst: Path) -> Path:
    """src quantized as mlx_lm.convert does (4 bits, group 32), with one layer
    at 8 bits / group 64 (a per-layer entry in the config), saved to dst."""
    from mlx_lm import load
    from mlx_lm.utils import quantize_model, save_config, save_model

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    model, _ = load(str(src))
    config = json.loads((src / "config.json").read_text())

    def predicate(path, module):
        return {"group_size": 64, "bits": 8} if path == "model.layers.0.mlp.down_proj" else True

    model, config = quantize_model(model, config, group_size=32, bits=4, quant_predicate=predicate)
    save_model(str(dst), model)
    save_config(config, config_path=str(dst / "config.json"))
    return dst


def greedy(model, tokenizer, n=12) -> list:
    from mlx_lm import generate
    text = generate(model, tokenizer, PROMPT, max_tokens=n, verbose=False)
    return tokenizer.encode(text)


def assert_same_model(path: Path):
    from mlx_lm import load
    ref, ref_tok = load(str(path))
    got, tok = weights.load_model_shared(path)
    x = mx.array([ref_tok.encode(PROMPT)])
    a, b = ref(x), got(x)
    assert a.dtype == b.dtype and mx.array_equal(a, b).item(), "logits differ from mlx_lm.load's"
    assert greedy(ref, ref_tok) == greedy(got, tok)
    assert [type(m).__name__ for _, m in ref.named_modules()] == \
        [type(m).__name__ for _, m in got.named_modules()]
    return got


def address(arr: mx.array) -> int:
    """The address of arr's first byte (a bfloat16 array through a same-size view)."""
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return np.array(arr, copy=False).ctypes.data


def mapped_regions(path) -> list:
    """(start, end, perms) of this process's mappings of the file at path."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                out.append((lo, hi, parts[1]))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype, aligned", [("float32", True), ("bfloat16", True),
                                            ("float32", False), ("float16", False)])
def test_logits_and_tokens_equal_mlx_lm(tmp_path, dtype, aligned, weights_dir):
    d = build_model_dir(tmp_path / dtype, "qwen2", dtype=dtype, **SMALL)
    if not aligned:
        make_unaligned(d)
    model = assert_same_model(d)
    # an aligned file is mapped in place; an unaligned one through one aligned copy
    assert (not weights_dir.exists()) == aligned
    # every weight is a view of the file mapping: no private copy
    m = weights.map_safetensors(d / "model.safetensors")
    assert m.private_bytes == 0 and m.shared_bytes > 0
    regions = mapped_regions(m.path)
    assert regions and all(p.startswith("r--s") for _, _, p in regions), regions
    for name, arr in tree_flatten(model.parameters()):
        addr = address(arr)
        assert any(lo <= addr < hi for lo, hi, _ in regions), f"{name} is not in the mapping"


@pytest.mark.timeout(120)
def test_quantized_with_a_per_layer_override_equals_mlx_lm(tmp_path):
    import mlx.nn as nn
    src = build_model_dir(tmp_path / "f32", "llama", **SMALL)
    q = quantized_dir(src, tmp_path / "q4")
    assert "model.layers.0.mlp.down_proj" in json.loads((q / "config.json").read_text())["quantization"]
    model = assert_same_model(q)
    assert model.model.layers[0].mlp.down_proj.bits == 8
    assert isinstance(model.model.layers[1].mlp.up_proj, nn.QuantizedLinear)
    regions = mapped_regions(weights.aligned_file(q / "model.safetensors"))
    for name, arr in tree_flatten(model.parameters()):
        addr = address(arr)
        assert any(lo <= addr < hi for lo, hi, _ in regions), f"{name} is not in the mapping"


def test_casts_make_new_arrays_and_the_file_is_unchanged(tmp_path, weights_dir):
    d = build_model_dir(tmp_path / "m", "llama", **SMALL)
    make_unaligned(d)
    before = (d / "model.safetensors").read_bytes()
    m = weights.map_safetensors(d / "model.safetensors")
    w = m.arrays["model.embed_tokens.weight"]
    want = np.array(w)
    for y in (w.astype(mx.float16), w * 1, mx.exp(w), w + 0):   # unary/binary ops could donate
        mx.eval(y)
        del y
    assert np.array_equal(np.array(w), want)
    aligned = Path(m.path)
    assert aligned.parent == weights_dir
    del m, w
    assert (d / "model.safetensors").read_bytes() == before
    # the aligned copy is itself aligned and holds the same tensors
    _, tensors = weights.read_safetensors_header(aligned)
    assert all(t.start % weights.ALIGN == 0 for t in tensors)
    ref = mx.load(str(d / "model.safetensors"))
    again = mx.load(str(aligned))
    assert ref.keys() == again.keys() and all(mx.array_equal(ref[k], again[k]).item() for k in ref)


DONATE = """
import sys
import mlx.core as mx
from shmcache.models import weights
m = weights.map_safetensors(sys.argv[1])
for name in list(m.arrays):
    for op in (mx.exp, lambda a: a.astype(mx.float16), lambda a: a + 1, lambda a: a.reshape(-1)):
        x = m.arrays.pop(name) if op is mx.exp else weights.map_safetensors(sys.argv[1]).arrays[name]
        y = op(x)      # x is the only holder: an owned buffer would be donated to y
        del x
        mx.eval(y)
print("ok")
"""


@pytest.mark.timeout(60)
def test_ops_on_sole_holders_do_not_write_into_the_mapping(tmp_path):
    # a write into the read-only mapping would kill the process with SIGSEGV
    d = build_model_dir(tmp_path / "m", "llama", **SMALL)
    before = (d / "model.safetensors").read_bytes()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", DONATE, str(d / "model.safetensors")], env=env,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])
    assert (d / "model.safetensors").read_bytes() == before


def test_demo_models_are_aligned_and_stale_copies_go(tmp_path, weights_dir):
    d = build_model_dir(tmp_path / "m", "llama", **SMALL)
    assert weights.aligned_file(d / "model.safetensors") == d / "model.safetensors"
    assert not weights_dir.exists()                          # nothing written for it
    # an unaligned file gets one copy; when the file changes, the next write
    # (of any copy) removes the old one, and so when the file is gone
    f = make_unaligned(d)
    first = weights.aligned_file(f)
    assert weights.aligned_file(f) == first and first.parent == weights_dir
    e = build_model_dir(tmp_path / "e", "llama", seed=1, **SMALL)
    make_unaligned(d)                                         # changed: another version
    second = weights.aligned_file(f)
    assert second != first and not first.exists() and second.exists()
    shutil.rmtree(d)
    third = weights.aligned_file(make_unaligned(e))
    assert not second.exists() and third.exists()
    assert sorted(p.name for p in weights_dir.iterdir()) == sorted(
        [".lock", third.name, third.name.split("-")[0] + ".json"])


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:5], "shorter than 8 bytes"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "does not fit the file"),
    (lambda b: b[:8] + b"\xff" + b[9:], "not JSON"),
    (lambda b: b[:-4], "not 64 bytes inside the file"),
])
def test_malformed_files_name_what_is_wrong(tmp_path, damage, message):
    f = tmp_path / "w.safetensors"
    mx.save_safetensors(str(f), {"x": mx.zeros((4, 4))})
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(ValueError, match=message) as e:
        weights.map_safetensors(f)
    assert str(f) in str(e.value)


def test_an_unmappable_model_falls_back_to_mlx_lm_with_the_reason(tmp_path, monkeypatch, caplog):
    d = build_model_dir(tmp_path / "m", "llama", **SMALL)
    monkeypatch.setenv("SHMCACHE_PURE", "1")
    with caplog.at_level("WARNING", logger="shmcache.models.weights"):
        model, _ = weights.load_model_shared(d)
    assert "SHMCACHE_PURE is set" in caplog.text
    assert model(mx.array([[1, 2, 3]])).shape[-1] > 0


def pss(pid) -> int:
    return psutil.Process(pid).memory_full_info().pss


def file_pss(pid, path) -> int:
    real = os.path.realpath(path)
    return sum(m.pss for m in psutil.Process(pid).memory_maps() if m.path == real)


@pytest.mark.timeout(180)
def test_three_processes_hold_about_one_copy(tmp_path, weights_dir):
    d = build_model_dir(tmp_path / "medium", "qwen2", **MEDIUM)
    make_unaligned(d)                       # the three race to write one aligned copy
    size = (d / "model.safetensors").stat().st_size
    assert size > 80e6
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = []
    try:
        for mode in ("private", "shared", "shared", "shared"):
            procs.append(subprocess.Popen([sys.executable, HELPER, mode, str(d)], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        digests = [p.stdout.readline().split() for p in procs]
        assert all(x[0] == "ready" for x in digests) and len({x[1] for x in digests}) == 1
        copies = list(weights_dir.glob("*.safetensors"))
        assert len(copies) == 1
        aligned = copies[0]
        # a process with a private copy: its PSS is the runtime plus one copy
        private = pss(procs[0].pid)
        procs[0].kill()
        procs[0].wait(timeout=30)
        procs = procs[1:]
        mapped = [file_pss(p.pid, aligned) for p in procs]
        total = [pss(p.pid) for p in procs]
        print(f"weights {size / 1e6:.1f} MB; PSS: private {private / 1e6:.1f} MB, "
              f"3 shared {[round(t / 1e6, 1) for t in total]} MB (of the file {sum(mapped) / 1e6:.1f} MB)")
        # the file's pages are shared: each holds a third of one copy
        assert 0.9 * size < sum(mapped) < 1.1 * size, (mapped, size)
        # and there is no private copy elsewhere: three runtimes and about one
        # copy, where three private copies would be three
        runtime = private - size
        assert sum(total) < 3 * runtime + 1.6 * size, (total, private, size)
        # one killed: the others go on, with the same logits, sharing the pages
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        for p in procs[1:]:
            p.stdin.write("again\n")
            p.stdin.flush()
            assert p.stdout.readline().split() == ["logits", digests[0][1]]
        assert 0.9 * size < sum(file_pss(p.pid, aligned) for p in procs[1:]) < 1.1 * size
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
