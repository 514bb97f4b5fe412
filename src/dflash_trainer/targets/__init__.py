"""The frozen target LLM.

- `loader`: load a model directory, a `.gguf` file (converted once into a cache) or a built-in name; stop ids,
  text config, the drafter's mask token id.
- `capture`: outputs of the tapped decoder layers with early exit, packed rows kept apart, the target's
  embedding and LM head.
- `regenerate`: rewrite the assistant turns of chat data with the target's own responses.
"""
