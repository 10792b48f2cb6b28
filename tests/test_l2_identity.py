"""Who may share an L2 entry (``shmcache.l2.identity``): the model's
identity follows its weights and the runtime."""

from __future__ import annotations

import pytest

from shmcache import l2 as L2

pytestmark = pytest.mark.timeout(120)


def test_model_identity_changes_with_the_weights(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    a = L2.model_identity(d)
    assert a.startswith("m@") and a == L2.model_identity(d)
    (d / "model.safetensors").write_bytes(b"y" * 1000)
    assert L2.model_identity(d) != a
    # another MLX or CPU architecture: another identity (the K/V bits may differ)
    assert L2.model_identity(d, runtime="mlx-0.1-arm64") != L2.model_identity(d)
