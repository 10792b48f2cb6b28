"""``shmcache serve --max-working-bytes``: a request whose working K/V
buffers could never fit a worker gets a 400 that says so; one that fits is
served (a real server, ``tests/_serve_proc.py``)."""

from __future__ import annotations

import openai
import pytest

from _serve_proc import MODEL_NAME, got, serving
from _serve_proc import model_dir, reference  # pytest fixtures

__all__ = ["model_dir", "reference"]


@pytest.mark.timeout(120)
def test_a_request_that_never_fits_the_working_bytes_is_a_400(model_dir, reference):
    # the demo model: 4 KiB of K/V per token; a 48-token row takes one 256-token
    # step, 1 MiB: one fits 3 MiB, four (n=4) do not
    with serving(model_dir, "--workers", 1, "--max-blocks", 64,
                 "--max-working-bytes", "3M") as srv:
        client = srv.client()
        prompt = list(range(40, 80))
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                      temperature=0)
        assert got(r) == reference.greedy(prompt, 8)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, n=4,
                                      temperature=0.5)
        assert "--max-working-bytes" in str(e.value), str(e.value)
