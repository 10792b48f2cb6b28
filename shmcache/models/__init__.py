"""Models: where the weights come from and how mlx-lm runs over the pool.

* ``model_source`` turns what the user named (nothing, a GGUF file, a
  directory) into an mlx-lm model directory; ``gguf`` converts llama-family
  GGUF files (float32 by default: MLX's CPU kernels are fast only there);
  ``demo_model`` builds the small random-weight models the tests use.
* ``weights`` maps one read-only copy of a model's safetensors for every
  worker (MLX arrays over a shared file mapping, no private copy).
* ``mlx_lm`` is mlx-lm's cache interface over the pool: a prompt's cached
  prefix is read from shared blocks, new blocks are published as they fill.

These modules use the manager and never the server.
"""
